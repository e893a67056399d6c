//go:build !kube_lt137

package main

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	draplugin "k8s.io/kubernetes/pkg/kubelet/cm/dra/plugin"
)

type draPlugin = draplugin.DRAPlugin

// registrarSocketFile is the helper's default registration socket name.
func registrarSocketFile(dir, driver string, uid types.UID) string {
	if uid == "" {
		return driver + "-reg.sock"
	}
	return kubeletplugin.RollingUpdateRegistrarSocketFile(dir, driver, uid)
}

// healthPlugin adds the 1.37 helper's WatchHealthStatus: "unsupported" declines (the helper
// answers the kubelet's stream with Unimplemented), "v1" sends one report and keeps the stream.
type healthPlugin struct {
	basePlugin
	mode string
}

func (p healthPlugin) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	if p.mode != "v1" {
		return kubeletplugin.ErrHealthNotSupported
	}
	select {
	case reports <- kubeletplugin.DeviceHealthReport{}:
	case <-ctx.Done():
		return nil
	}
	<-ctx.Done()
	return nil
}

func pluginImpl(d *driver, health string) (kubeletplugin.DRAPlugin, []kubeletplugin.Option, error) {
	p := healthPlugin{basePlugin: basePlugin{d: d}, mode: health}
	switch health {
	case "off":
		return p, []kubeletplugin.Option{kubeletplugin.HealthService(false)}, nil
	case "unsupported", "v1":
		return p, nil, nil
	}
	return nil, nil, fmt.Errorf("--health %q: off, unsupported or v1", health)
}

// stopManager waits for the DRA plugin manager's goroutines (Manager.Stop, new in 1.37).
func stopManager(m *dra.Manager) { m.Stop() }
