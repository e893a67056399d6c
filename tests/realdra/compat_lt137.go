//go:build kube_lt137

package main

// The DRA manager's and the plugin helper's API as of k8s.io/kubernetes v1.36 (releases/go.1.36.mod, -tags kube_lt137).

import (
	"fmt"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	draplugin "k8s.io/kubernetes/pkg/kubelet/cm/dra/plugin"
)

type draPlugin = draplugin.DRAPlugin

// registrarSocketFile is the 1.36 helper's default registration socket name.
func registrarSocketFile(_ string, driver string, uid types.UID) string {
	if uid == "" {
		return driver + "-reg.sock"
	}
	return driver + "-" + string(uid) + "-reg.sock"
}

// pluginImpl: the 1.36 helper advertises DRAResourceHealth only for a plugin implementing the
// v1alpha1 server; this one does not ("off"), as most drivers of that time.
func pluginImpl(d *driver, health string) (kubeletplugin.DRAPlugin, []kubeletplugin.Option, error) {
	if health != "off" {
		return nil, nil, fmt.Errorf("--health %q: the 1.36 helper's driver here has only off", health)
	}
	return basePlugin{d: d}, nil, nil
}

// stopManager: the 1.36 DRA manager has no Stop; its context's cancellation ends it.
func stopManager(*dra.Manager) {}
