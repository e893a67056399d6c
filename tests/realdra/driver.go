package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	"hami-guard/tests/fixturekit"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
)

type driverOptions struct {
	name       string
	registry   string
	pluginDir  string
	regSocket  string
	rollingUID string
	health     string
	node       string
	verbosity  string
	kubeconfig string
	refuse     bool
}

func parseDriverFlags(args []string) (driverOptions, error) {
	var o driverOptions
	fs := flag.NewFlagSet("driver", flag.ContinueOnError)
	fs.StringVar(&o.name, "name", "", "the DRA driver's name")
	fs.StringVar(&o.registry, "registry", "", "the kubelet's plugins_registry folder")
	fs.StringVar(&o.pluginDir, "plugin-dir", "", "the driver's own folder for its DRA service socket")
	fs.StringVar(&o.regSocket, "reg-socket", "", "the registration socket's file name (default: the helper's)")
	fs.StringVar(&o.rollingUID, "rolling-uid", "", "a pod UID: the helper's rolling-update mode (a socket per instance)")
	fs.StringVar(&o.health, "health", "off", "the DRAResourceHealth service: off, unsupported (1.37 helper only), v1 (1.37 helper only)")
	fs.StringVar(&o.node, "node", "node-1", "the node's name")
	fs.StringVar(&o.verbosity, "v", "2", "klog verbosity")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "a real API server (default: a fake client); publish needs it")
	fs.BoolVar(&o.refuse, "refuse", false, "refuse NotifyRegistrationStatus from the start (the refuse switch turns it off)")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if o.name == "" || o.registry == "" || o.pluginDir == "" {
		return o, errors.New("--name, --registry and --plugin-dir are required")
	}
	return o, nil
}

// driver is a DRA kubelet plugin on the helper, with switches the tests turn: refuse the kubelet's
// NotifyRegistrationStatus, fail GetInfo, hang every call or only the DRA service's, stall the DRA
// service's listener. It counts the calls it receives.
type driver struct {
	o      driverOptions
	helper *kubeletplugin.Helper
	hung   gate
	// serviceHung: only the DRA service's calls block (registration answers): a driver whose
	// prepare path deadlocked.
	serviceHung gate
	mu          sync.Mutex
	calls       map[string]int
	svc         *serviceListener
	// refusing: NotifyRegistrationStatus fails from the first call (--refuse), before the helper's own
	// switch could be set: the kubelet's plugin watcher may call as soon as the socket exists.
	refusing atomic.Bool
}

// serviceListener is the DRA service's listener as the helper makes it (remove a stale file, listen),
// keeping the connections it accepted so that a test can end them ("drop") or stop serving ("service off").
type serviceListener struct {
	net.Listener
	mu      sync.Mutex
	conns   []net.Conn
	stalled chan struct{} // while open (non-nil), Accept hands nothing to gRPC
	closed  chan struct{}
	once    sync.Once
}

func newServiceListener(l net.Listener) *serviceListener {
	return &serviceListener{Listener: l, closed: make(chan struct{})}
}

func (l *serviceListener) Accept() (net.Conn, error) {
	if err := l.whileStalled(nil); err != nil {
		return nil, err
	}
	c, err := l.Listener.Accept()
	if err != nil {
		return c, err
	}
	// A connection accepted as the stall began waits, unread, as those in the backlog do.
	if err := l.whileStalled(c); err != nil {
		return nil, err
	}
	l.mu.Lock()
	l.conns = append(l.conns, c)
	l.mu.Unlock()
	return c, nil
}

// whileStalled waits while the listener is stalled: the kernel still completes every connect into
// the listen backlog, nothing reads it, so a client waits for the server's HTTP/2 preface that
// never comes. A held connection is closed when the listener closes.
func (l *serviceListener) whileStalled(held net.Conn) error {
	l.mu.Lock()
	stalled := l.stalled
	l.mu.Unlock()
	if stalled == nil {
		return nil
	}
	select {
	case <-stalled:
		return nil
	case <-l.closed:
		if held != nil {
			_ = held.Close()
		}
		return net.ErrClosed
	}
}

func (l *serviceListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

// stall stops (on) or resumes (off) accepting; on also ends the connections already accepted,
// so that the kubelet's reconnection lands in the backlog.
func (l *serviceListener) stall(on bool) int {
	l.mu.Lock()
	if on && l.stalled == nil {
		l.stalled = make(chan struct{})
	} else if !on && l.stalled != nil {
		close(l.stalled)
		l.stalled = nil
	}
	l.mu.Unlock()
	if on {
		return l.drop()
	}
	return 0
}

func (l *serviceListener) drop() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(l.conns)
	for _, c := range l.conns {
		_ = c.Close()
	}
	l.conns = nil
	return n
}

// gate blocks callers while it is on.
type gate struct {
	mu sync.Mutex
	ch chan struct{} // non-nil while on; closed when it turns off
}

func (g *gate) set(on bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if on && g.ch == nil {
		g.ch = make(chan struct{})
	} else if !on && g.ch != nil {
		close(g.ch)
		g.ch = nil
	}
}

func (g *gate) wait(ctx context.Context) error {
	g.mu.Lock()
	ch := g.ch
	g.mu.Unlock()
	if ch == nil {
		return nil
	}
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func driverMain(args []string) int {
	o, err := parseDriverFlags(args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "realdra driver:", err)
		return 2
	}
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	_ = fs.Set("v", o.verbosity)
	klog.SetOutput(os.Stderr)
	_ = fs.Set("logtostderr", "false")
	_ = fs.Set("stderrthreshold", "FATAL")
	defer klog.Flush()
	d := &driver{o: o, calls: map[string]int{}}
	d.refusing.Store(o.refuse)
	if err := d.start(); err != nil {
		fixturekit.Event("start-failed", map[string]any{"error": err.Error()})
		fmt.Fprintln(os.Stderr, "realdra driver:", err)
		return 1
	}
	regFile := o.regSocket
	if regFile == "" {
		regFile = registrarSocketFile(o.registry, o.name, types.UID(o.rollingUID))
	}
	draFile := "dra.sock"
	if o.rollingUID != "" {
		draFile = "dra-" + o.rollingUID + ".sock"
	}
	fixturekit.Event("ready", map[string]any{
		"pid": os.Getpid(), "release": kubernetesRelease,
		"registration": filepath.Join(o.registry, regFile), "service": path.Join(o.pluginDir, draFile),
	})
	fixturekit.ServeCommands(d.handle)
	d.helper.Stop()
	return 0
}

func (d *driver) start() error {
	if err := os.MkdirAll(d.o.pluginDir, 0o750); err != nil {
		return err
	}
	var client kubernetes.Interface = fake.NewSimpleClientset(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: d.o.node}})
	if d.o.kubeconfig != "" {
		real, err := apiClient(d.o.kubeconfig)
		if err != nil {
			return err
		}
		client = real
	}
	opts := []kubeletplugin.Option{
		kubeletplugin.DriverName(d.o.name),
		kubeletplugin.RegistrarDirectoryPath(d.o.registry),
		kubeletplugin.PluginDataDirectoryPath(d.o.pluginDir),
		kubeletplugin.KubeClient(client),
		kubeletplugin.NodeName(d.o.node),
		kubeletplugin.GRPCInterceptor(d.unary),
		kubeletplugin.GRPCStreamInterceptor(d.stream),
		kubeletplugin.PluginListener(func(_ context.Context, path string) (net.Listener, error) {
			if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
				return nil, err
			}
			l, err := net.Listen("unix", path)
			if err != nil {
				return nil, err
			}
			d.svc = newServiceListener(l)
			return d.svc, nil
		}),
	}
	if d.o.regSocket != "" {
		opts = append(opts, kubeletplugin.RegistrarSocketFilename(d.o.regSocket))
	}
	if d.o.rollingUID != "" {
		opts = append(opts, kubeletplugin.RollingUpdate(types.UID(d.o.rollingUID)))
	}
	impl, more, err := pluginImpl(d, d.o.health)
	if err != nil {
		return err
	}
	ctx := klog.NewContext(context.Background(), klog.Background())
	h, err := kubeletplugin.Start(ctx, impl, append(opts, more...)...)
	if err != nil {
		return err
	}
	d.helper = h
	return nil
}

func (d *driver) count(method string) {
	d.mu.Lock()
	d.calls[path.Base(method)]++
	d.mu.Unlock()
	fixturekit.Event("call", map[string]any{"method": path.Base(method)})
}

// registrationService prefixes the plugin registration API's methods (GetInfo, NotifyRegistrationStatus).
const registrationService = "/pluginregistration.Registration/"

// wait blocks while the driver is hung (a driver whose gRPC server accepts but never answers), or
// while its DRA service is hung and the method is the DRA service's.
func (d *driver) wait(ctx context.Context, method string) error {
	if err := d.hung.wait(ctx); err != nil {
		return err
	}
	if strings.HasPrefix(method, registrationService) {
		return nil
	}
	return d.serviceHung.wait(ctx)
}

func (d *driver) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	d.count(info.FullMethod)
	if err := d.wait(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	if info.FullMethod == registrationService+"NotifyRegistrationStatus" && d.refusing.Load() {
		return nil, status.Error(codes.FailedPrecondition, "refused by the test")
	}
	return handler(ctx, req)
}

func (d *driver) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	d.count(info.FullMethod)
	if err := d.wait(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return handler(srv, ss)
}

func (d *driver) handle(c fixturekit.Command) bool {
	on := len(c.Args) == 1 && c.Args[0] == "on"
	switch c.Name {
	case "refuse":
		var err error
		if on {
			err = status.Error(codes.FailedPrecondition, "refused by the test")
		}
		setRegistrationStatusError(d.helper, err)
		d.refusing.Store(on)
		c.Reply(nil, nil)
	case "getinfo-error":
		var err error
		if on {
			err = status.Error(codes.Internal, "GetInfo fails by the test")
		}
		d.helper.SetGetInfoError(err)
		c.Reply(nil, nil)
	case "hang":
		d.hung.set(on)
		c.Reply(nil, nil)
	case "hang-service":
		d.serviceHung.set(on)
		c.Reply(nil, nil)
	case "stall-service":
		// The DRA service's listener stops accepting (on) or accepts again (off); registration answers.
		c.Reply(map[string]any{"dropped": d.svc.stall(on)}, nil)
	case "drop":
		// The kubelet's connections to the DRA service end; the listener stays.
		c.Reply(map[string]any{"dropped": d.svc.drop()}, nil)
	case "service-off":
		// The DRA service's listener closes (its socket file goes) and its connections end; the
		// registration socket keeps answering: a driver whose DRA server died.
		// A listener the gRPC server already closed (its Serve ended: see the driver-error events)
		// is off already: said so, not an error.
		err := d.svc.Close()
		already := errors.Is(err, net.ErrClosed)
		if already {
			err = nil
		}
		c.Reply(map[string]any{"dropped": d.svc.drop(), "already_closed": already}, err)
	case "publish":
		// The helper's ResourceSlice controller publishes one slice of N devices for this node
		// (it keeps them as published: it re-creates what is deleted).
		n := 0
		if len(c.Args) == 1 {
			_, _ = fmt.Sscanf(c.Args[0], "%d", &n)
		}
		c.Reply(nil, d.publish(n))
	case "status":
		calls := map[string]int{}
		d.mu.Lock()
		for k, v := range d.calls {
			calls[k] = v
		}
		d.mu.Unlock()
		out := map[string]any{"calls": calls, "registration": nil}
		if s := d.helper.RegistrationStatus(); s != nil {
			out["registration"] = map[string]any{"registered": s.PluginRegistered, "error": s.Error}
		}
		c.Reply(out, nil)
	case "stop", "quit":
		c.Reply(nil, nil)
		return true
	default:
		c.Reply(nil, fmt.Errorf("unknown command %q", c.Name))
	}
	return false
}

func (d *driver) publish(n int) error {
	devices := make([]resourceapi.Device, n)
	for i := range devices {
		devices[i] = resourceapi.Device{Name: fmt.Sprintf("gpu-%d", i)}
	}
	pool := resourceslice.Pool{Slices: []resourceslice.Slice{{Devices: devices}}}
	return d.helper.PublishResources(context.Background(), resourceslice.DriverResources{
		Pools: map[string]resourceslice.Pool{d.o.node: pool},
	})
}

// basePlugin prepares and unprepares nothing: the tests never allocate a claim.
type basePlugin struct{ d *driver }

func (basePlugin) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	fixturekit.Event("prepare", map[string]any{"claims": len(claims)})
	out := map[types.UID]kubeletplugin.PrepareResult{}
	for _, c := range claims {
		out[c.UID] = kubeletplugin.PrepareResult{}
	}
	return out, nil
}

func (basePlugin) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := map[types.UID]error{}
	for _, c := range claims {
		out[c.UID] = nil
	}
	return out, nil
}

func (basePlugin) HandleError(_ context.Context, err error, msg string) {
	fixturekit.Event("driver-error", map[string]any{"error": err.Error(), "msg": msg})
}
