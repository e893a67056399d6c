package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"hami-guard/tests/fixturekit"

	"github.com/fsnotify/fsnotify"
	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	podresourcesv1alpha1 "k8s.io/kubelet/pkg/apis/podresources/v1alpha1"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
)

const checkpointName = "kubelet_internal_checkpoint"

type kubeletOptions struct {
	dir              string
	podResources     string
	capacityInterval time.Duration
	numaNodes        int
	verbosity        string
}

func parseKubeletFlags(args []string) (kubeletOptions, error) {
	var o kubeletOptions
	fs := flag.NewFlagSet("kubelet", flag.ContinueOnError)
	fs.StringVar(&o.dir, "dir", "", "the test's device-plugins folder (bind-mounted at "+kubeletDevicePluginDir+")")
	fs.StringVar(&o.podResources, "pod-resources", "", "where the PodResources API listens (outside --dir)")
	fs.DurationVar(&o.capacityInterval, "capacity-interval", 10*time.Second,
		"call GetCapacity this often, as the node status loop does (0: only on the capacity command)")
	fs.IntVar(&o.numaNodes, "numa-nodes", 2, "NUMA nodes of the machine topology given to the device manager")
	fs.StringVar(&o.verbosity, "v", "4", "klog verbosity")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if o.dir == "" {
		return o, errors.New("--dir is required")
	}
	if o.podResources != "" {
		absDir, _ := filepath.Abs(o.dir)
		absPR, _ := filepath.Abs(o.podResources)
		if strings.HasPrefix(absPR, absDir+string(filepath.Separator)) {
			return o, errors.New("--pod-resources must be outside --dir: the kubelet's start-up cleanup would delete it")
		}
	}
	return o, nil
}

// kubeletMain checks the flags, then re-executes itself in a mount namespace of its own.
func kubeletMain(args []string) int {
	if _, err := parseKubeletFlags(args); err != nil {
		fmt.Fprintln(os.Stderr, "realkubelet kubelet:", err)
		return 2
	}
	return enterMountNamespace(args)
}

// kubelet holds the real device manager and what the kubelet around it would supply.
type kubelet struct {
	opts     kubeletOptions
	logger   klog.Logger
	manager  *devicemanager.ManagerImpl
	podsMu   sync.Mutex
	pods     map[types.UID]*v1.Pod
	prServer *grpc.Server

	cpMu        sync.Mutex
	checkpoints int
}

func kubeletChildMain(args []string) int {
	o, err := parseKubeletFlags(args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "realkubelet kubelet:", err)
		return 2
	}
	fixturekit.SetupKlog(o.verbosity)
	defer klog.Flush()
	if err := bindDevicePluginDir(o.dir); err != nil {
		fixturekit.Event("start-failed", map[string]any{"error": err.Error()})
		fmt.Fprintln(os.Stderr, "realkubelet kubelet:", err)
		return 1
	}
	k := &kubelet{opts: o, logger: klog.Background(), pods: map[types.UID]*v1.Pod{}}
	if err := k.start(); err != nil {
		fixturekit.Event("start-failed", map[string]any{"error": err.Error()})
		fmt.Fprintln(os.Stderr, "realkubelet kubelet:", err)
		return 1
	}
	fixturekit.Event("ready", map[string]any{
		"pid": os.Getpid(), "release": kubernetesRelease,
		"socket": filepath.Join(o.dir, "kubelet.sock"), "pod_resources": o.podResources,
	})
	if o.capacityInterval > 0 {
		go func() {
			for range time.Tick(o.capacityInterval) {
				getCapacity(k.manager, k.logger)
			}
		}()
	}
	fixturekit.ServeCommands(k.handle)
	// A stop command or the end of stdin (the driver went away): stop gracefully.
	k.stop()
	return 0
}

func (k *kubelet) start() error {
	k.adoptCheckpointPods()
	m, err := newManager(k.logger, k.opts.numaNodes)
	if err != nil {
		return fmt.Errorf("NewManagerImpl: %w", err)
	}
	k.manager = m
	if err := k.watchCheckpoint(); err != nil {
		return err
	}
	// The manager's own Start: reads the checkpoint, cleans the folder, listens on kubelet.sock.
	if err := startManager(m, k.logger, k.activePods, fixturekit.SourcesReady{}, containermap.NewContainerMap(), sets.New[string]()); err != nil {
		return fmt.Errorf("device manager Start: %w", err)
	}
	if k.opts.podResources != "" {
		if err := k.servePodResources(); err != nil {
			return err
		}
	}
	return nil
}

func (k *kubelet) stop() {
	if err := stopManager(k.manager, k.logger); err != nil {
		k.logger.Error(err, "device manager Stop")
	}
	if k.prServer != nil {
		k.prServer.Stop()
	}
}

// servePodResources serves the kubelet's own PodResources servers as the kubelet does
// (pkg/kubelet/server ListenAndServePodResources): rate limited, v1alpha1 and v1.
func (k *kubelet) servePodResources() error {
	ctx := klog.NewContext(context.Background(), k.logger)
	providers := podResourcesProviders(k.manager, podsProvider{k})
	server := grpc.NewServer(rateLimiter(ctx, "podresources", podresources.DefaultQPS, podresources.DefaultBurstTokens))
	podresourcesv1alpha1.RegisterPodResourcesListerServer(server, podresources.NewV1alpha1PodResourcesServer(providers))
	podresourcesv1.RegisterPodResourcesListerServer(server, newV1PodResourcesServer(ctx, providers))
	if err := os.MkdirAll(filepath.Dir(k.opts.podResources), 0o750); err != nil {
		return err
	}
	if err := os.Remove(k.opts.podResources); err != nil && !os.IsNotExist(err) {
		return err
	}
	l, err := net.Listen("unix", k.opts.podResources)
	if err != nil {
		return fmt.Errorf("pod-resources listen: %w", err)
	}
	k.prServer = server
	go func() {
		if err := server.Serve(l); err != nil {
			k.logger.Error(err, "pod-resources server")
		}
	}()
	return nil
}

// watchCheckpoint reports every (atomic, rename-based) write of the checkpoint as an event.
func (k *kubelet) watchCheckpoint() error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	if err := w.Add(kubeletDevicePluginDir); err != nil {
		return err
	}
	target := filepath.Join(kubeletDevicePluginDir, checkpointName)
	go func() {
		for {
			select {
			case e, ok := <-w.Events:
				if !ok {
					return
				}
				if e.Name == target && e.Op&(fsnotify.Create|fsnotify.Write) != 0 {
					k.cpMu.Lock()
					k.checkpoints++
					n := k.checkpoints
					k.cpMu.Unlock()
					fixturekit.Event("checkpoint", map[string]any{"count": n})
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

// adoptCheckpointPods treats the pods named in the checkpoint as still running, as they are
// after a kubelet restart; otherwise the manager would free their devices at the next Allocate.
func (k *kubelet) adoptCheckpointPods() {
	raw, err := os.ReadFile(filepath.Join(kubeletDevicePluginDir, checkpointName))
	if err != nil {
		return
	}
	var cp struct {
		Data struct {
			PodDeviceEntries []struct {
				PodUID        string
				ContainerName string
				ResourceName  string
			}
		}
	}
	if json.Unmarshal(raw, &cp) != nil {
		return
	}
	for _, e := range cp.Data.PodDeviceEntries {
		k.pod(e.PodUID, e.ContainerName, e.ResourceName, 0)
	}
}

// pod returns the (active) pod with that UID, adding the container with its limit.
func (k *kubelet) pod(uid, container, res string, n int64) (*v1.Pod, *v1.Container) {
	k.podsMu.Lock()
	defer k.podsMu.Unlock()
	p, ok := k.pods[types.UID(uid)]
	if !ok {
		p = &v1.Pod{}
		p.UID, p.Name, p.Namespace = types.UID(uid), uid, "default"
		p.Status.Phase = v1.PodRunning
		k.pods[p.UID] = p
	}
	for i := range p.Spec.Containers {
		if p.Spec.Containers[i].Name == container {
			c := &p.Spec.Containers[i]
			if n > 0 {
				c.Resources.Limits[v1.ResourceName(res)] = *resource.NewQuantity(n, resource.DecimalSI)
			}
			return p, c
		}
	}
	c := v1.Container{Name: container, Resources: v1.ResourceRequirements{Limits: v1.ResourceList{}}}
	if n > 0 {
		c.Resources.Limits[v1.ResourceName(res)] = *resource.NewQuantity(n, resource.DecimalSI)
	}
	p.Spec.Containers = append(p.Spec.Containers, c)
	return p, &p.Spec.Containers[len(p.Spec.Containers)-1]
}

func (k *kubelet) activePods() []*v1.Pod {
	k.podsMu.Lock()
	defer k.podsMu.Unlock()
	pods := make([]*v1.Pod, 0, len(k.pods))
	for _, p := range k.pods {
		pods = append(pods, p)
	}
	return pods
}

func (k *kubelet) handle(c fixturekit.Command) bool {
	switch c.Name {
	case "ping":
		c.Reply(nil, nil)
	case "capacity":
		capacity, allocatable, removed := getCapacity(k.manager, k.logger)
		sort.Strings(removed)
		c.Reply(map[string]any{
			"capacity": quantities(capacity), "allocatable": quantities(allocatable), "removed": removed,
		}, nil)
	case "allocate":
		if len(c.Args) != 4 {
			c.Reply(nil, errors.New("usage: allocate POD CONTAINER RESOURCE N"))
			return false
		}
		n, err := strconv.ParseInt(c.Args[3], 10, 64)
		if err != nil || n <= 0 {
			c.Reply(nil, fmt.Errorf("bad device count %q", c.Args[3]))
			return false
		}
		pod, container := k.pod(c.Args[0], c.Args[1], c.Args[2], n)
		ctx := klog.NewContext(context.Background(), k.logger)
		err = allocate(ctx, k.manager, pod, container)
		ids := sortedKeys(k.manager.GetDevices(string(pod.UID), container.Name)[c.Args[2]])
		c.Reply(map[string]any{"devices": ids}, err)
	case "state":
		k.cpMu.Lock()
		written := k.checkpoints
		k.cpMu.Unlock()
		pods := map[string]map[string]map[string][]string{}
		for _, p := range k.activePods() {
			for _, ctr := range p.Spec.Containers {
				for res, devs := range k.manager.GetDevices(string(p.UID), ctr.Name) {
					if pods[string(p.UID)] == nil {
						pods[string(p.UID)] = map[string]map[string][]string{}
					}
					if pods[string(p.UID)][ctr.Name] == nil {
						pods[string(p.UID)][ctr.Name] = map[string][]string{}
					}
					pods[string(p.UID)][ctr.Name][res] = sortedKeys(devs)
				}
			}
		}
		c.Reply(map[string]any{
			"devices": deviceView(allocatableDevices(k.manager, k.logger)), "pods": pods,
			"checkpoints_written": written, "release": kubernetesRelease,
		}, nil)
	case "stop":
		c.Reply(nil, nil)
		return true
	default:
		c.Reply(nil, fmt.Errorf("unknown command %q", c.Name))
	}
	return false
}

// deviceView: resource -> device ID -> {health, numa}.
func deviceView(rdi devicemanager.ResourceDeviceInstances) map[string]map[string]map[string]any {
	view := map[string]map[string]map[string]any{}
	for res, devs := range rdi {
		view[res] = map[string]map[string]any{}
		for id, d := range devs {
			numa := []int64{}
			for _, n := range d.GetTopology().GetNodes() {
				numa = append(numa, n.GetID())
			}
			view[res][id] = map[string]any{"health": d.GetHealth(), "numa": numa}
		}
	}
	return view
}

func quantities(l v1.ResourceList) map[string]int64 {
	out := map[string]int64{}
	for name, q := range l {
		out[string(name)] = q.Value()
	}
	return out
}

func sortedKeys(devs devicemanager.DeviceInstances) []string {
	ids := make([]string, 0, len(devs))
	for id := range devs {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// containerDevices converts the manager's device map for the PodResources API: one entry per
// (device, NUMA node), one without topology for a device that reports none. These few lines
// stand for the container manager's unexported helper (pkg/kubelet/cm/container_manager.go).
func containerDevices(rdi devicemanager.ResourceDeviceInstances) []*podresourcesv1.ContainerDevices {
	var out []*podresourcesv1.ContainerDevices
	for res, devs := range rdi {
		for id, d := range devs {
			nodes := d.GetTopology().GetNodes()
			if len(nodes) == 0 {
				out = append(out, &podresourcesv1.ContainerDevices{ResourceName: res, DeviceIds: []string{id}})
				continue
			}
			for _, n := range nodes {
				out = append(out, &podresourcesv1.ContainerDevices{
					ResourceName: res, DeviceIds: []string{id},
					Topology: &podresourcesv1.TopologyInfo{Nodes: []*podresourcesv1.NUMANode{{ID: n.GetID()}}},
				})
			}
		}
	}
	return out
}

// machineTopology is cadvisor's view of a machine with numa NUMA nodes (each node's Id set).
func machineTopology[N any](numa int) []N {
	nodes := make([]N, numa)
	for i := range nodes {
		reflect.ValueOf(&nodes[i]).Elem().FieldByName("Id").SetInt(int64(i))
	}
	return nodes
}

// podsProvider answers the PodResources server from the pods the fixture allocated for.
type podsProvider struct{ k *kubelet }

func (p podsProvider) GetActivePods() []*v1.Pod { return p.k.activePods() }
func (p podsProvider) GetPods() []*v1.Pod       { return p.k.activePods() }
func (p podsProvider) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	for _, pod := range p.k.activePods() {
		if pod.Namespace == namespace && pod.Name == name {
			return pod, true
		}
	}
	return nil, false
}
