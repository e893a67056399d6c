//go:build !kube_lt136

package main

// The DRA manager's and the plugin helper's API from k8s.io/kubernetes v1.36 on.

import (
	"context"

	"hami-guard/tests/fixturekit"

	v1 "k8s.io/api/core/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
)

// startManager starts the DRA manager with no active pods and ready pod sources.
func startManager(ctx context.Context, m *dra.Manager, getNode func(context.Context) (*v1.Node, error)) error {
	return m.Start(ctx, func() []*v1.Pod { return nil }, getNode, fixturekit.SourcesReady{})
}

// setRegistrationStatusError turns the helper's own refusal of NotifyRegistrationStatus on (err) or
// off (nil); the interceptor refuses too, from the driver's start (--refuse).
func setRegistrationStatusError(h *kubeletplugin.Helper, err error) {
	h.SetNotifyRegistrationStatusError(err)
}
