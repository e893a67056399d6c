//go:build kube_lt137

package main

// The device manager's API before k8s.io/kubernetes v1.37 (-tags kube_lt137): NewManagerImpl,
// GetCapacity, Allocate and the PodResources providers take no logger, context or operation.

import (
	"context"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
)

// newManager builds the manager as the kubelet's container manager does, with the topology
// manager's default policy ("none", container scope) as its affinity store.
func newManager(_ klog.Logger, numa int) (*devicemanager.ManagerImpl, error) {
	return buildManager(numa, topologymanager.NewManager, devicemanager.NewManagerImpl)
}

// buildManager takes the cadvisor node type from the constructors' signatures, so this module
// needs no cadvisor import of its own (a direct one would bend the other release's versions).
func buildManager[N any](numa int,
	newTopology func([]N, string, string, map[string]string) (topologymanager.Manager, error),
	newDevices func([]N, topologymanager.Store) (*devicemanager.ManagerImpl, error),
) (*devicemanager.ManagerImpl, error) {
	topology := machineTopology[N](numa)
	tm, err := newTopology(topology, "none", "container", nil)
	if err != nil {
		return nil, err
	}
	return newDevices(topology, tm)
}

func getCapacity(m *devicemanager.ManagerImpl, _ klog.Logger) (v1.ResourceList, v1.ResourceList, []string) {
	return m.GetCapacity()
}

func allocate(_ context.Context, m *devicemanager.ManagerImpl, pod *v1.Pod, c *v1.Container) error {
	return m.Allocate(pod, c)
}

func allocatableDevices(m *devicemanager.ManagerImpl, _ klog.Logger) devicemanager.ResourceDeviceInstances {
	return m.GetAllocatableDevices()
}

type devicesProvider struct{ m *devicemanager.ManagerImpl }

func (d devicesProvider) UpdateAllocatedDevices() { d.m.UpdateAllocatedDevices() }
func (d devicesProvider) GetDevices(podUID, containerName string) []*podresourcesv1.ContainerDevices {
	return containerDevices(d.m.GetDevices(podUID, containerName))
}
func (d devicesProvider) GetAllocatableDevices() []*podresourcesv1.ContainerDevices {
	return containerDevices(d.m.GetAllocatableDevices())
}

// noResources: the fixture manages devices only (no CPU, memory or DRA managers).
type noResources struct{}

func (noResources) GetCPUs(string, string) []int64                             { return nil }
func (noResources) GetAllocatableCPUs() []int64                                { return nil }
func (noResources) GetMemory(string, string) []*podresourcesv1.ContainerMemory { return nil }
func (noResources) GetAllocatableMemory() []*podresourcesv1.ContainerMemory    { return nil }
func (noResources) GetDynamicResources(*v1.Pod, *v1.Container) []*podresourcesv1.DynamicResource {
	return nil
}

func podResourcesProviders(m *devicemanager.ManagerImpl, pods podresources.PodsProvider) podresources.PodResourcesProviders {
	return podresources.PodResourcesProviders{
		Pods: pods, Devices: devicesProvider{m}, Cpus: noResources{}, Memory: noResources{}, DynamicResources: noResources{},
	}
}
