//go:build !kube_lt137

package main

// The device manager's API from k8s.io/kubernetes v1.37 on (go.mod).

import (
	"context"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
)

// newManager builds the manager as the kubelet's container manager does, with the topology
// manager's default policy ("none", container scope) as its affinity store.
func newManager(logger klog.Logger, numa int) (*devicemanager.ManagerImpl, error) {
	return buildManager(logger, numa, topologymanager.NewManager, devicemanager.NewManagerImpl)
}

// buildManager takes the cadvisor node type from the constructors' signatures, so this module
// needs no cadvisor import of its own (a direct one would bend the other release's versions).
func buildManager[N any](logger klog.Logger, numa int,
	newTopology func(klog.Logger, []N, string, string, map[string]string) (topologymanager.Manager, error),
	newDevices func(klog.Logger, []N, topologymanager.Store) (*devicemanager.ManagerImpl, error),
) (*devicemanager.ManagerImpl, error) {
	topology := machineTopology[N](numa)
	tm, err := newTopology(logger, topology, "none", "container", nil)
	if err != nil {
		return nil, err
	}
	return newDevices(logger, topology, tm)
}

func getCapacity(m *devicemanager.ManagerImpl, logger klog.Logger) (v1.ResourceList, v1.ResourceList, []string) {
	return m.GetCapacity(logger)
}

func allocate(ctx context.Context, m *devicemanager.ManagerImpl, pod *v1.Pod, c *v1.Container) error {
	return m.Allocate(ctx, pod, c, lifecycle.AddOperation)
}

func allocatableDevices(m *devicemanager.ManagerImpl, logger klog.Logger) devicemanager.ResourceDeviceInstances {
	return m.GetAllocatableDevices(logger)
}

type devicesProvider struct{ m *devicemanager.ManagerImpl }

func (d devicesProvider) UpdateAllocatedDevices(logger klog.Logger) {
	d.m.UpdateAllocatedDevices(logger)
}
func (d devicesProvider) GetDevices(podUID, containerName string) []*podresourcesv1.ContainerDevices {
	return containerDevices(d.m.GetDevices(podUID, containerName))
}
func (d devicesProvider) GetAllocatableDevices(logger klog.Logger) []*podresourcesv1.ContainerDevices {
	return containerDevices(d.m.GetAllocatableDevices(logger))
}

// noResources: the fixture manages devices only (no CPU, memory or DRA managers).
type noResources struct{}

func (noResources) GetCPUs(*v1.Pod, *v1.Container) []int64 { return nil }
func (noResources) GetPodCPUs(string) []int64              { return nil }
func (noResources) GetAllocatableCPUs() []int64            { return nil }
func (noResources) GetMemory(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesv1.ContainerMemory {
	return nil
}
func (noResources) GetPodMemory(klog.Logger, string) []*podresourcesv1.ContainerMemory { return nil }
func (noResources) GetAllocatableMemory(klog.Logger) []*podresourcesv1.ContainerMemory { return nil }
func (noResources) GetDynamicResources(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesv1.DynamicResource {
	return nil
}

func podResourcesProviders(m *devicemanager.ManagerImpl, pods podresources.PodsProvider) podresources.PodResourcesProviders {
	return podresources.PodResourcesProviders{
		Pods: pods, Devices: devicesProvider{m}, Cpus: noResources{}, Memory: noResources{}, DynamicResources: noResources{},
	}
}
