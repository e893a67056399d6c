package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"hami-guard/tests/fixturekit"

	"github.com/fsnotify/fsnotify"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type pluginOptions struct {
	dir           string
	socket        string
	resource      string
	devices       []string
	impl          string
	watchKubelet  bool
	register      bool
	retryInterval time.Duration
}

type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, " ") }
func (s *stringList) Set(v string) error { *s = append(*s, strings.Fields(v)...); return nil }

func parsePluginFlags(args []string) (pluginOptions, error) {
	o := pluginOptions{}
	var devices stringList
	var noWatch bool
	fs := flag.NewFlagSet("plugin", flag.ContinueOnError)
	fs.StringVar(&o.dir, "dir", "", "the device-plugins folder")
	fs.StringVar(&o.socket, "socket", "nvidia-gpu.sock", "socket name in --dir (the Register endpoint)")
	fs.StringVar(&o.resource, "resource", "nvidia.com/gpu", "extended resource name")
	fs.Var(&devices, "devices", "devices, ID[@numa[,numa]], repeatable or blank-separated")
	fs.StringVar(&o.impl, "impl", "own", "own: the fixture's plugin; stub: the kubelet's own test Stub")
	fs.BoolVar(&o.watchKubelet, "watch-kubelet", true, "restart and register again when kubelet.sock is created")
	fs.BoolVar(&noWatch, "no-watch-kubelet", false, "miss the creation of kubelet.sock")
	fs.BoolVar(&o.register, "register", true, "register at start (after serving)")
	fs.DurationVar(&o.retryInterval, "retry-interval", 0, "retry a failed Register after this long (0: never)")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if noWatch {
		o.watchKubelet = false
	}
	o.devices = append(devices, fs.Args()...)
	if o.dir == "" {
		return o, errors.New("--dir is required")
	}
	if o.impl != "own" && o.impl != "stub" {
		return o, fmt.Errorf("--impl must be own or stub, not %q", o.impl)
	}
	if _, err := parseDevices(o.devices); err != nil {
		return o, err
	}
	return o, nil
}

// parseDevices reads ID[@numa[,numa]] words; every device starts Healthy.
func parseDevices(words []string) ([]*pluginapi.Device, error) {
	devs := []*pluginapi.Device{}
	for _, w := range words {
		id, numa, hasNuma := strings.Cut(w, "@")
		if id == "" {
			return nil, fmt.Errorf("bad device %q", w)
		}
		d := &pluginapi.Device{ID: id, Health: pluginapi.Healthy}
		if hasNuma {
			d.Topology = &pluginapi.TopologyInfo{}
			for _, n := range strings.Split(numa, ",") {
				v, err := strconv.ParseInt(n, 10, 64)
				if err != nil {
					return nil, fmt.Errorf("bad NUMA node in %q", w)
				}
				d.Topology.Nodes = append(d.Topology.Nodes, &pluginapi.NUMANode{ID: v})
			}
		}
		devs = append(devs, d)
	}
	return devs, nil
}

// pluginImpl is what the command loop drives.
type pluginImpl interface {
	serve() error
	stopServing() error
	register() error
	setDevices(devs []*pluginapi.Device) (map[string]any, error)
	setHealth(id, health string) (map[string]any, error)
	restart(register bool) error
	endStream(which string) (map[string]any, error)
	state() map[string]any
	onKubeletCreated()
}

func pluginMain(args []string) int {
	o, err := parsePluginFlags(args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "realkubelet plugin:", err)
		return 2
	}
	setupKlogStderr()
	defer klog.Flush()
	devs, _ := parseDevices(o.devices)
	var p pluginImpl
	if o.impl == "stub" {
		p = newStubPlugin(o, devs)
	} else {
		p = newOwnPlugin(o, devs)
	}
	var opMu sync.Mutex // one lifecycle operation at a time: a command or a kubelet.sock event
	if err := p.serve(); err != nil {
		fixturekit.Event("start-failed", map[string]any{"error": err.Error()})
		return 1
	}
	if sp, ok := p.(*stubPlugin); ok && o.watchKubelet {
		// Stub's own watch: on kubelet.sock creation, Restart then Register.
		go sp.stub.Watch(sp.ctx, sp.kubeletSocket(), o.resource, "")
	} else if o.watchKubelet {
		if err := watchKubeletSocket(o.dir, func() { opMu.Lock(); defer opMu.Unlock(); p.onKubeletCreated() }); err != nil {
			fixturekit.Event("start-failed", map[string]any{"error": err.Error()})
			return 1
		}
	}
	fixturekit.Event("ready", map[string]any{"pid": os.Getpid(), "release": kubernetesRelease, "impl": o.impl,
		"socket": filepath.Join(o.dir, o.socket)})
	if o.register {
		opMu.Lock()
		_ = p.register()
		opMu.Unlock()
	}
	fixturekit.ServeCommands(func(c fixturekit.Command) bool {
		opMu.Lock()
		defer opMu.Unlock()
		switch c.Name {
		case "ping":
			c.Reply(nil, nil)
		case "register":
			c.Reply(nil, p.register())
		case "serve":
			c.Reply(nil, p.serve())
		case "stop":
			c.Reply(nil, p.stopServing())
		case "restart":
			c.Reply(nil, p.restart(true))
		case "restart-server-only":
			c.Reply(nil, p.restart(false))
		case "end-stream":
			which := "oldest"
			if len(c.Args) == 1 {
				which = c.Args[0]
			} else if len(c.Args) > 1 {
				c.Reply(nil, errors.New("usage: end-stream [oldest|newest|ID]"))
				return false
			}
			c.Reply(p.endStream(which))
		case "devices":
			devs, err := parseDevices(c.Args)
			if err != nil {
				c.Reply(nil, err)
				return false
			}
			c.Reply(p.setDevices(devs))
		case "health":
			if len(c.Args) != 2 || (c.Args[1] != pluginapi.Healthy && c.Args[1] != pluginapi.Unhealthy) {
				c.Reply(nil, errors.New("usage: health ID Healthy|Unhealthy"))
				return false
			}
			c.Reply(p.setHealth(c.Args[0], c.Args[1]))
		case "state":
			c.Reply(p.state(), nil)
		case "quit":
			_ = p.stopServing()
			c.Reply(nil, nil)
			return true
		default:
			c.Reply(nil, fmt.Errorf("unknown command %q", c.Name))
		}
		return false
	})
	opMu.Lock()
	_ = p.stopServing()
	opMu.Unlock()
	return 0
}

// watchKubeletSocket calls created (in a goroutine of its own) each time kubelet.sock is created
// in dir, as HAMi's and NVIDIA's plugins watch for a kubelet restart.
func watchKubeletSocket(dir string, created func()) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	if err := w.Add(dir); err != nil {
		return err
	}
	target := filepath.Join(dir, "kubelet.sock")
	go func() {
		for {
			select {
			case e, ok := <-w.Events:
				if !ok {
					return
				}
				if e.Name == target && e.Op&fsnotify.Create != 0 {
					fixturekit.Event("kubelet-sock-created", nil)
					go created()
				}
			case _, ok := <-w.Errors:
				if !ok {
					return
				}
			}
		}
	}()
	return nil
}

func setupKlogStderr() {
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	_ = fs.Set("v", "2")
	klog.SetOutput(os.Stderr)
	_ = fs.Set("logtostderr", "false")
	_ = fs.Set("stderrthreshold", "FATAL")
}

// kubeletRegister calls Register, waiting for kubelet.sock to accept a connection as HAMi's and
// NVIDIA's plugins do (their dial blocks): inotify reports kubelet.sock at bind(), before the
// kubelet's listen(), and a plain dial at that moment is refused.
func kubeletRegister(ctx context.Context, kubeletSocket string, req *pluginapi.RegisterRequest) error {
	conn, err := newGRPCClient("unix://"+kubeletSocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, req, grpc.WaitForReady(true))
	return err
}

// ownPlugin is the fixture's device plugin: it sees each ListAndWatch stream end (its context),
// pushes every change to every open stream, counts calls, and can serve again after a stop.
type ownPlugin struct {
	pluginapi.UnimplementedDevicePluginServer
	o    pluginOptions
	path string

	mu               sync.Mutex
	devices          []*pluginapi.Device // replaced, never changed in place: streams send it outside mu
	generation       int                 // of devices: 0 at start, one more at each change
	server           *grpc.Server
	inode            uint64
	streams          map[int]chan struct{}
	ends             map[int]chan struct{} // closed to end that stream while the server keeps serving
	nextStream       int
	calls            map[string]int
	registrations    int
	registerFailures int
	lastError        string
	retry            *time.Timer
}

func newOwnPlugin(o pluginOptions, devs []*pluginapi.Device) *ownPlugin {
	return &ownPlugin{o: o, path: filepath.Join(o.dir, o.socket), devices: devs,
		streams: map[int]chan struct{}{}, ends: map[int]chan struct{}{}, calls: map[string]int{}}
}

func (p *ownPlugin) serve() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.server != nil {
		return errors.New("already serving")
	}
	if err := os.Remove(p.path); err != nil && !os.IsNotExist(err) {
		return err
	}
	l, err := net.Listen("unix", p.path)
	if err != nil {
		return err
	}
	// Unlink only a socket file that is still this listener's (another instance may own the path).
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	var st syscall.Stat_t
	if err := syscall.Stat(p.path, &st); err != nil {
		l.Close()
		return err
	}
	p.inode = st.Ino
	p.server = grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(p.server, p)
	go func(s *grpc.Server) { _ = s.Serve(l) }(p.server)
	fixturekit.Event("serving", map[string]any{"inode": p.inode})
	return nil
}

func (p *ownPlugin) stopServing() error {
	p.mu.Lock()
	s, inode := p.server, p.inode
	p.server = nil
	if p.retry != nil {
		p.retry.Stop()
	}
	p.mu.Unlock()
	if s == nil {
		return nil
	}
	s.Stop() // closes the listener and every connection: the kubelet's stream ends
	var st syscall.Stat_t
	if syscall.Stat(p.path, &st) == nil && st.Ino == inode {
		_ = os.Remove(p.path)
	}
	fixturekit.Event("stopped", nil)
	return nil
}

func (p *ownPlugin) restart(register bool) error {
	if err := p.stopServing(); err != nil {
		return err
	}
	if err := p.serve(); err != nil {
		return err
	}
	if register {
		return p.register()
	}
	return nil
}

func (p *ownPlugin) onKubeletCreated() { _ = p.restart(true) }

func (p *ownPlugin) register() error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err := kubeletRegister(ctx, filepath.Join(p.o.dir, "kubelet.sock"), &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: p.o.socket, ResourceName: p.o.resource,
		Options: &pluginapi.DevicePluginOptions{},
	})
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		p.registerFailures++
		p.lastError = err.Error()
		fixturekit.Event("register-failed", map[string]any{"error": err.Error(), "failures": p.registerFailures})
		if p.o.retryInterval > 0 && p.server != nil {
			p.retry = time.AfterFunc(p.o.retryInterval, func() { _ = p.register() })
		}
		return err
	}
	p.registrations++
	fixturekit.Event("registered", map[string]any{"registrations": p.registrations})
	return nil
}

// endStream ends one open ListAndWatch stream ("oldest", "newest" or its number) as a plugin
// returning from the handler does: the call completes, the connection and the server stay.
func (p *ownPlugin) endStream(which string) (map[string]any, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	ids := make([]int, 0, len(p.ends))
	for id := range p.ends {
		ids = append(ids, id)
	}
	if len(ids) == 0 {
		return nil, errors.New("no open stream")
	}
	sort.Ints(ids)
	id := ids[0]
	switch which {
	case "oldest":
	case "newest":
		id = ids[len(ids)-1]
	default:
		n, err := strconv.Atoi(which)
		if err != nil || p.ends[n] == nil {
			return nil, fmt.Errorf("no open stream %q", which)
		}
		id = n
	}
	close(p.ends[id])
	delete(p.ends, id)
	return map[string]any{"stream": id}, nil
}

// notify wakes every open stream after a change; a stream woken again before it sends sends only
// the newest list. The reply's generation is the one a `sent` event names once it is sent.
func (p *ownPlugin) notify() map[string]any {
	p.generation++
	for _, ch := range p.streams {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	return map[string]any{"streams": len(p.streams), "generation": p.generation}
}

func (p *ownPlugin) setDevices(devs []*pluginapi.Device) (map[string]any, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.devices = devs
	return p.notify(), nil
}

func (p *ownPlugin) setHealth(id, health string) (map[string]any, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, d := range p.devices {
		if d.ID == id {
			// A new list, never a change in place: a stream may be marshalling the current one
			// outside the lock, and a Health that changes length between gRPC's size pass and its
			// write pass sends bytes the kubelet cannot parse, so it ends the stream and drops us.
			devs := append([]*pluginapi.Device{}, p.devices...)
			devs[i] = &pluginapi.Device{ID: d.ID, Health: health, Topology: d.Topology}
			p.devices = devs
			return p.notify(), nil
		}
	}
	return nil, fmt.Errorf("no device %q", id)
}

func (p *ownPlugin) state() map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	calls := map[string]int{}
	for k, v := range p.calls {
		calls[k] = v
	}
	ids := []string{}
	for _, d := range p.devices {
		ids = append(ids, d.ID+"="+d.Health)
	}
	sort.Strings(ids)
	return map[string]any{
		"impl": "own", "streams_open": len(p.streams), "calls": calls, "registrations": p.registrations,
		"register_failures": p.registerFailures, "last_error": p.lastError, "serving": p.server != nil,
		"inode": p.inode, "devices": ids, "generation": p.generation,
	}
}

func (p *ownPlugin) count(method string) {
	p.mu.Lock()
	p.calls[method]++
	p.mu.Unlock()
}

func (p *ownPlugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	p.count("GetDevicePluginOptions")
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *ownPlugin) ListAndWatch(_ *pluginapi.Empty, s pluginapi.DevicePlugin_ListAndWatchServer) error {
	ch := make(chan struct{}, 1)
	p.mu.Lock()
	p.calls["ListAndWatch"]++
	id := p.nextStream
	p.nextStream++
	p.streams[id] = ch
	end := make(chan struct{})
	p.ends[id] = end
	open := len(p.streams)
	devs, generation := p.devices, p.generation
	p.mu.Unlock()
	fixturekit.Event("stream-open", map[string]any{"stream": id, "open": open})
	defer func() {
		p.mu.Lock()
		delete(p.streams, id)
		delete(p.ends, id)
		open := len(p.streams)
		p.mu.Unlock()
		fixturekit.Event("stream-closed", map[string]any{"stream": id, "open": open})
	}()
	sent := -1
	for {
		// A wake-up can trail the change it announces: a change made between a wake-up and the read
		// of the list is sent at once, and its own wake-up then finds nothing new. One send for each
		// generation, so that a driver that waited for a generation's `sent` has every list sent.
		if generation != sent {
			if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: devs}); err != nil {
				return err
			}
			sent = generation
			// Sent: in the stream's transport, not yet read by the kubelet.
			fixturekit.Event("sent", map[string]any{"stream": id, "generation": generation,
				"devices": len(devs), "healthy": healthyCount(devs)})
		}
		select {
		case <-s.Context().Done():
			return nil
		case <-end:
			return nil // the plugin ends the stream; its server and the connection stay
		case <-ch:
			p.mu.Lock()
			devs, generation = p.devices, p.generation
			p.mu.Unlock()
		}
	}
}

func healthyCount(devs []*pluginapi.Device) int {
	n := 0
	for _, d := range devs {
		if d.Health == pluginapi.Healthy {
			n++
		}
	}
	return n
}

func (p *ownPlugin) GetPreferredAllocation(_ context.Context, r *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	p.count("GetPreferredAllocation")
	resp := &pluginapi.PreferredAllocationResponse{}
	for _, cr := range r.ContainerRequests {
		ids := append([]string{}, cr.MustIncludeDeviceIDs...)
		for _, id := range cr.AvailableDeviceIDs {
			if len(ids) >= int(cr.AllocationSize) {
				break
			}
			ids = append(ids, id)
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: ids})
	}
	return resp, nil
}

func (p *ownPlugin) Allocate(_ context.Context, r *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	p.count("Allocate")
	return allocateResponse(p.o.socket, r), nil
}

func (p *ownPlugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	p.count("PreStartContainer")
	return &pluginapi.PreStartContainerResponse{}, nil
}

// allocateResponse names the devices (and the socket that answered) in an environment variable.
func allocateResponse(socket string, r *pluginapi.AllocateRequest) *pluginapi.AllocateResponse {
	resp := &pluginapi.AllocateResponse{}
	for _, cr := range r.ContainerRequests {
		ids := append([]string{}, containerRequestIDs(cr)...)
		sort.Strings(ids)
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"FIXTURE_DEVICES": strings.Join(ids, ","), "FIXTURE_SOCKET": socket},
		})
	}
	return resp
}
