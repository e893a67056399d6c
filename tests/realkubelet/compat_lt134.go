//go:build kube_lt134

package main

// Before k8s.io/kubernetes v1.34 (-tags kube_lt134), the PodResources v1 server and the kubelet's
// gRPC rate limiter take no context, the manager's device maps hold values, and the device plugin
// API's Go types are gogo/protobuf's.

import (
	"context"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	apisgrpc "k8s.io/kubernetes/pkg/kubelet/apis/grpc"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
)

func rateLimiter(_ context.Context, service string, qps, burst int32) grpc.ServerOption {
	return apisgrpc.WithRateLimiter(service, qps, burst)
}

func newV1PodResourcesServer(_ context.Context, p podresources.PodResourcesProviders) podresourcesv1.PodResourcesListerServer {
	return podresources.NewV1PodResourcesServer(p)
}

// stubDevices is the device map Stub hands its Allocate function (devicemanager.DeviceInstances).
type stubDevices = map[string]pluginapi.Device

// containerRequestIDs: the device plugin API's Go types are gogo/protobuf's before 1.34.
func containerRequestIDs(r *pluginapi.ContainerAllocateRequest) []string { return r.GetDevicesIDs() }
