//go:build kube_lt135

package main

// Before k8s.io/kubernetes v1.35 (-tags kube_lt135), the manager's Start and Stop and the test
// plugin Stub take no logger or context: stubServer gives Stub the newer methods' shape.

import (
	"context"

	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	plugin "k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/config"
)

func startManager(m *devicemanager.ManagerImpl, _ klog.Logger, pods devicemanager.ActivePodsFunc,
	ready config.SourcesReady, containers containermap.ContainerMap, running sets.Set[string]) error {
	return m.Start(pods, ready, containers, running)
}

func stopManager(m *devicemanager.ManagerImpl, _ klog.Logger) error { return m.Stop() }

type stubServer struct{ *plugin.Stub }

func newStubServer(_ klog.Logger, devs []*pluginapi.Device, socket, resource string) *stubServer {
	return &stubServer{plugin.NewDevicePluginStub(devs, socket, resource, false, false)}
}

func (s *stubServer) Start(context.Context) error   { return s.Stub.Start() }
func (s *stubServer) Restart(context.Context) error { return s.Stub.Restart() }
func (s *stubServer) Stop(klog.Logger) error        { return s.Stub.Stop() }
func (s *stubServer) Register(_ context.Context, kubeletEndpoint, resourceName, pluginSockDir string) error {
	return s.Stub.Register(kubeletEndpoint, resourceName, pluginSockDir)
}
func (s *stubServer) Watch(_ context.Context, kubeletEndpoint, resourceName, pluginSockDir string) {
	s.Stub.Watch(kubeletEndpoint, resourceName, pluginSockDir)
}
