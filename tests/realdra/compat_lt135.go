//go:build kube_lt135

package main

// The plugin manager's API and the DRA API's Go types before k8s.io/kubernetes v1.35 (1.34:
// releases/go.1.34.mod, -tags kube_lt135,kube_lt136,kube_lt137).

import (
	"context"
	"fmt"
	"os"

	"hami-guard/tests/fixturekit"

	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

// runPluginManager: the 1.34 plugin manager's Run takes no context.
func runPluginManager(_ context.Context, pm pluginmanager.PluginManager, stopCh chan struct{}) {
	pm.Run(fixturekit.SourcesReady{}, stopCh)
}

// vectorsMain: 1.34's k8s.io/kubelet/pkg/apis/dra/v1 types are gogo/protobuf's (no protoreflect, no
// method-name constants), so the wire vectors come from 1.36 and 1.37 (tests/test_dra_proto.py).
func vectorsMain() int {
	fmt.Fprintln(os.Stderr, "vectors: not at 1.34 (gogo/protobuf types); use the 1.36 or 1.37 fixture")
	return 2
}
