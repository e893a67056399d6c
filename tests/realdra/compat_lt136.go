//go:build kube_lt136

package main

// The DRA manager's and the plugin helper's API before k8s.io/kubernetes v1.36 (1.34, 1.35:
// releases/go.1.MINOR.mod, -tags kube_lt136,kube_lt137).

import (
	"context"

	"hami-guard/tests/fixturekit"

	v1 "k8s.io/api/core/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
)

// startManager: before 1.36 the DRA manager's GetNodeFunc takes no context.
func startManager(ctx context.Context, m *dra.Manager, getNode func(context.Context) (*v1.Node, error)) error {
	node := func() (*v1.Node, error) { return getNode(ctx) }
	return m.Start(ctx, func() []*v1.Pod { return nil }, node, fixturekit.SourcesReady{})
}

// setRegistrationStatusError: the helper has no switch of its own before 1.36
// (SetNotifyRegistrationStatusError is new in v0.36); the driver's interceptor refuses alone.
func setRegistrationStatusError(*kubeletplugin.Helper, error) {}
