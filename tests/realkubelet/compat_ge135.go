//go:build !kube_lt135

package main

// From k8s.io/kubernetes v1.35 on, the manager's Start and Stop and the test plugin Stub take a
// logger or a context.

import (
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	plugin "k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/config"
)

func startManager(m *devicemanager.ManagerImpl, logger klog.Logger, pods devicemanager.ActivePodsFunc,
	ready config.SourcesReady, containers containermap.ContainerMap, running sets.Set[string]) error {
	return m.Start(logger, pods, ready, containers, running)
}

func stopManager(m *devicemanager.ManagerImpl, logger klog.Logger) error { return m.Stop(logger) }

type stubServer = plugin.Stub

func newStubServer(logger klog.Logger, devs []*pluginapi.Device, socket, resource string) *stubServer {
	return plugin.NewDevicePluginStub(logger, devs, socket, resource, false, false)
}
