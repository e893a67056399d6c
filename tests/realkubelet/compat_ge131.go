//go:build !kube_lt131

package main

import "google.golang.org/grpc"

// newGRPCClient: grpc.NewClient, in the grpc that k8s.io/kubernetes pins from 1.31 on (v1.65.0).
func newGRPCClient(target string, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	return grpc.NewClient(target, opts...)
}
