//go:build !kube_lt134

package main

// From k8s.io/kubernetes v1.34 on, the PodResources v1 server and the kubelet's gRPC rate limiter
// take a context, and the manager's device maps hold pointers.

import (
	"context"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	apisgrpc "k8s.io/kubernetes/pkg/kubelet/apis/grpc"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
)

func rateLimiter(ctx context.Context, service string, qps, burst int32) grpc.ServerOption {
	return apisgrpc.WithRateLimiter(ctx, service, qps, burst)
}

func newV1PodResourcesServer(ctx context.Context, p podresources.PodResourcesProviders) podresourcesv1.PodResourcesListerServer {
	return podresources.NewV1PodResourcesServer(ctx, p)
}

// stubDevices is the device map Stub hands its Allocate function (devicemanager.DeviceInstances).
type stubDevices = map[string]*pluginapi.Device

// containerRequestIDs: the device plugin API's Go types are protoc-gen-go's from 1.34 on.
func containerRequestIDs(r *pluginapi.ContainerAllocateRequest) []string { return r.GetDevicesIds() }
