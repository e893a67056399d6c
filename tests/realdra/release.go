package main

import "runtime/debug"

// kubernetesRelease is the k8s.io/kubernetes version this binary was built with (its modfile's).
var kubernetesRelease = func() string {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, d := range info.Deps {
			if d.Path == "k8s.io/kubernetes" {
				return d.Version
			}
		}
	}
	return "unknown"
}()
