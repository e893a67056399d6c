package main

import (
	"context"
	"errors"
	"path/filepath"
	"time"

	"hami-guard/tests/fixturekit"

	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// stubPlugin drives the kubelet's own test plugin, Stub. What Stub cannot do, this says: it does
// not see its stream end (streams_open is null), Update blocks while no stream reads it, and it
// cannot serve again after Stop.
type stubPlugin struct {
	o       pluginOptions
	stub    *stubServer
	ctx     context.Context
	devices []*pluginapi.Device
	stopped bool
	started bool
}

func newStubPlugin(o pluginOptions, devs []*pluginapi.Device) *stubPlugin {
	ctx := klog.NewContext(context.Background(), klog.Background())
	s := newStubServer(klog.Background(), devs, filepath.Join(o.dir, o.socket), o.resource)
	s.SetAllocFunc(func(r *pluginapi.AllocateRequest, _ stubDevices) (*pluginapi.AllocateResponse, error) {
		return allocateResponse(o.socket, r), nil
	})
	return &stubPlugin{o: o, stub: s, ctx: ctx, devices: devs}
}

func (p *stubPlugin) kubeletSocket() string { return filepath.Join(p.o.dir, "kubelet.sock") }

func (p *stubPlugin) serve() error {
	if p.stopped {
		return errors.New("the kubelet's Stub cannot serve again after Stop")
	}
	if p.started {
		return errors.New("already serving")
	}
	if err := p.stub.Start(p.ctx); err != nil {
		return err
	}
	p.started = true
	return nil
}

func (p *stubPlugin) stopServing() error {
	if p.stopped {
		return nil
	}
	p.stopped = true
	return p.stub.Stop(klog.Background())
}

func (p *stubPlugin) register() error {
	err := p.stub.Register(p.ctx, p.kubeletSocket(), p.o.resource, "")
	if err != nil {
		fixturekit.Event("register-failed", map[string]any{"error": err.Error()})
		return err
	}
	fixturekit.Event("registered", nil)
	return nil
}

func (p *stubPlugin) restart(register bool) error {
	if p.stopped {
		return errors.New("the kubelet's Stub cannot serve again after Stop")
	}
	if err := p.stub.Restart(p.ctx); err != nil {
		return err
	}
	if register {
		return p.register()
	}
	return nil
}

// endStream: Stub's ListAndWatch ends only with its server.
func (p *stubPlugin) endStream(string) (map[string]any, error) {
	return nil, errors.New("the kubelet's Stub cannot end a stream while it serves")
}

// onKubeletCreated is not used: Stub watches kubelet.sock itself (Stub.Watch).
func (p *stubPlugin) onKubeletCreated() {}

// update hands the list to Stub.Update, which blocks until a ListAndWatch stream takes it.
func (p *stubPlugin) update() map[string]any {
	devs := append([]*pluginapi.Device{}, p.devices...)
	done := make(chan struct{})
	go func() { p.stub.Update(devs); close(done) }()
	select {
	case <-done:
		return map[string]any{"delivered": true}
	case <-time.After(2 * time.Second):
		return map[string]any{"delivered": false}
	}
}

func (p *stubPlugin) setDevices(devs []*pluginapi.Device) (map[string]any, error) {
	p.devices = devs
	return p.update(), nil
}

func (p *stubPlugin) setHealth(id, health string) (map[string]any, error) {
	for i, d := range p.devices {
		if d.ID == id {
			p.devices[i] = &pluginapi.Device{ID: d.ID, Health: health, Topology: d.Topology}
			return p.update(), nil
		}
	}
	return nil, errors.New("no device " + id)
}

func (p *stubPlugin) state() map[string]any {
	return map[string]any{"impl": "stub", "streams_open": nil, "calls": nil, "serving": p.started && !p.stopped}
}
