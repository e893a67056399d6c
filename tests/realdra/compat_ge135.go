//go:build !kube_lt135

package main

// The plugin manager's API from k8s.io/kubernetes v1.35 on.

import (
	"context"

	"hami-guard/tests/fixturekit"

	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

// runPluginManager runs the plugin manager until stopCh closes, its pod sources ready.
func runPluginManager(ctx context.Context, pm pluginmanager.PluginManager, stopCh chan struct{}) {
	pm.Run(ctx, fixturekit.SourcesReady{}, stopCh)
}
