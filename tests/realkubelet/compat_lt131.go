//go:build kube_lt131

package main

import "google.golang.org/grpc"

// newGRPCClient: k8s.io/kubernetes 1.30 pins grpc v1.58.3, which has no grpc.NewClient (v1.63);
// grpc.Dial without WithBlock connects in the background as NewClient's first call does.
func newGRPCClient(target string, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	return grpc.Dial(target, opts...)
}
