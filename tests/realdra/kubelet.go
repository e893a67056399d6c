package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"reflect"
	"sort"
	"sync"
	"time"
	"unsafe"

	"hami-guard/tests/fixturekit"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
)

type kubeletOptions struct {
	registry   string
	state      string
	node       string
	socket     string
	verbosity  string
	kubeconfig string
}

func parseKubeletFlags(args []string) (kubeletOptions, error) {
	var o kubeletOptions
	fs := flag.NewFlagSet("kubelet", flag.ContinueOnError)
	fs.StringVar(&o.registry, "registry", "", "the folder the plugin watcher watches (the kubelet's plugins_registry)")
	fs.StringVar(&o.state, "state", "", "the DRA manager's state folder (its checkpoints)")
	fs.StringVar(&o.node, "node", "node-1", "the node's name (the fake API server holds this Node)")
	fs.StringVar(&o.socket, "kubelet-socket", "", "listen here as every kubelet listens on device-plugins/kubelet.sock "+
		"(its device manager's registration socket): the sign of a running kubelet (accepts, serves nothing)")
	fs.StringVar(&o.verbosity, "v", "4", "klog verbosity")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "a real API server for the DRA manager (its ResourceSlice wipes); "+
		"default: a fake API client that reports each wipe as an event")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if o.registry == "" || o.state == "" {
		return o, errors.New("--registry and --state are required")
	}
	return o, nil
}

// kubelet holds the real plugin manager and DRA manager, wired as the kubelet's container manager
// and Kubelet.Run wire them (pkg/kubelet/kubelet.go: AddHandler(pluginwatcherapi.DRAPlugin, ...)).
type kubelet struct {
	opts    kubeletOptions
	logger  klog.Logger
	client  kubernetes.Interface
	manager *dra.Manager
	plugins pluginmanager.PluginManager
	cancel  context.CancelFunc
	stopCh  chan struct{}
	wg      sync.WaitGroup
	sock    net.Listener
}

func kubeletMain(args []string) int {
	o, err := parseKubeletFlags(args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "realdra kubelet:", err)
		return 2
	}
	fixturekit.SetupKlog(o.verbosity)
	defer klog.Flush()
	k := &kubelet{opts: o, logger: klog.Background()}
	if err := k.start(); err != nil {
		fixturekit.Event("start-failed", map[string]any{"error": err.Error()})
		fmt.Fprintln(os.Stderr, "realdra kubelet:", err)
		return 1
	}
	fixturekit.Event("ready", map[string]any{"pid": os.Getpid(), "release": kubernetesRelease, "registry": o.registry, "socket": o.socket})
	fixturekit.ServeCommands(k.handle)
	k.stop()
	return 0
}

func (k *kubelet) start() error {
	if err := os.MkdirAll(k.opts.state, 0o750); err != nil {
		return err
	}
	if k.opts.kubeconfig != "" {
		// The real API server: the Node must exist there; the wipes are real DeleteCollections.
		client, err := apiClient(k.opts.kubeconfig)
		if err != nil {
			return err
		}
		k.client = client
	} else {
		node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: k.opts.node, UID: "realdra-node-uid"}}
		client := fake.NewSimpleClientset(node)
		// The DRA manager wipes a driver's ResourceSlices when no plugin of it is usable for its
		// wiping delay, and all of the node's at start: report each DeleteCollection (the kubelet's
		// verdict that the driver is gone).
		client.PrependReactor("delete-collection", "resourceslices", func(a k8stesting.Action) (bool, runtime.Object, error) {
			selector := ""
			if dc, ok := a.(k8stesting.DeleteCollectionAction); ok {
				selector = dc.GetListRestrictions().Fields.String()
			}
			fixturekit.Event("wipe", map[string]any{"selector": selector})
			return true, nil, nil
		})
		k.client = client
	}
	m, err := dra.NewManager(k.logger, k.client, k.opts.state)
	if err != nil {
		return fmt.Errorf("dra.NewManager: %w", err)
	}
	k.manager = m
	ctx, cancel := context.WithCancel(klog.NewContext(context.Background(), k.logger))
	k.cancel = cancel
	getNode := func(ctx context.Context) (*v1.Node, error) {
		return k.client.CoreV1().Nodes().Get(ctx, k.opts.node, metav1.GetOptions{})
	}
	if err := startManager(ctx, m, getNode); err != nil {
		return fmt.Errorf("dra manager Start: %w", err)
	}
	k.plugins = pluginmanager.NewPluginManager(k.opts.registry, &record.FakeRecorder{})
	k.plugins.AddHandler(registerapi.DRAPlugin, m.GetWatcherHandler())
	if k.opts.socket != "" {
		if err := os.Remove(k.opts.socket); err != nil && !os.IsNotExist(err) {
			return err
		}
		l, err := net.Listen("unix", k.opts.socket)
		if err != nil {
			return fmt.Errorf("kubelet socket: %w", err)
		}
		k.sock = l
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				_ = c.Close()
			}
		}()
	}
	k.stopCh = make(chan struct{})
	k.wg.Add(1)
	go func() {
		defer k.wg.Done()
		runPluginManager(ctx, k.plugins, k.stopCh)
	}()
	return nil
}

func (k *kubelet) stop() {
	close(k.stopCh)
	k.cancel()
	stopManager(k.manager)
	k.wg.Wait()
	if k.sock != nil {
		_ = k.sock.Close() // removes the socket file, as a kubelet's orderly stop does
	}
}

func (k *kubelet) handle(c fixturekit.Command) bool {
	switch c.Name {
	case "state":
		c.Reply(k.state(), nil)
	case "call":
		if len(c.Args) != 1 {
			c.Reply(nil, errors.New("usage: call DRIVER"))
			return false
		}
		c.Reply(k.call(c.Args[0]))
	case "stop", "quit":
		c.Reply(nil, nil)
		return true
	default:
		c.Reply(nil, fmt.Errorf("unknown command %q", c.Name))
	}
	return false
}

// call asks the DRA manager for the driver's plugin and makes the kubelet's own call on its own
// connection: an empty NodePrepareResources, which changes nothing.
func (k *kubelet) call(driver string) (map[string]any, error) {
	handler, ok := k.manager.GetWatcherHandler().(interface {
		GetPlugin(string) (*draPlugin, error)
	})
	if !ok {
		return nil, errors.New("the DRA handler has no GetPlugin")
	}
	p, err := handler.GetPlugin(driver)
	if err != nil {
		return map[string]any{"registered": false}, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	_, err = p.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{})
	return map[string]any{"registered": true}, err
}

// state reads the plugin manager's actual state of world (the sockets it registered) and the DRA
// plugin manager's store (each driver's endpoints and whether gRPC reports each connected), under
// the store's own lock. Both are unexported: read with reflect, as a debugger would.
func (k *kubelet) state() map[string]any {
	asw := []map[string]any{}
	pm := reflect.ValueOf(k.plugins).Elem()
	if f := pm.FieldByName("actualStateOfWorld"); f.IsValid() {
		w := *(*cache.ActualStateOfWorld)(unsafe.Pointer(f.UnsafeAddr()))
		for _, p := range w.GetRegisteredPlugins() {
			asw = append(asw, map[string]any{"socket": p.SocketPath, "name": p.Name, "endpoint": p.Endpoint})
		}
	}
	sort.Slice(asw, func(i, j int) bool { return asw[i]["socket"].(string) < asw[j]["socket"].(string) })
	drivers := map[string]any{}
	h := reflect.ValueOf(k.manager.GetWatcherHandler()).Elem()
	mu := (*sync.RWMutex)(unsafe.Pointer(h.FieldByName("mutex").UnsafeAddr()))
	mu.RLock()
	store := h.FieldByName("store")
	for _, key := range store.MapKeys() {
		list := store.MapIndex(key)
		endpoints := []map[string]any{}
		for i := 0; i < list.Len(); i++ {
			mp := list.Index(i).Elem()
			p := mp.FieldByName("DRAPlugin").Elem()
			e := map[string]any{
				"endpoint":  p.FieldByName("endpoint").String(),
				"connected": mp.FieldByName("connected").Bool(),
				"service":   p.FieldByName("chosenService").String(),
			}
			if hs := p.FieldByName("chosenHealthService"); hs.IsValid() {
				e["health_service"] = hs.String()
			}
			endpoints = append(endpoints, e)
		}
		drivers[key.String()] = endpoints
	}
	mu.RUnlock()
	return map[string]any{"asw": asw, "drivers": drivers}
}
