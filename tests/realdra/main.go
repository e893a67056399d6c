// Command realdra runs the kubelet's own plugin manager (pkg/kubelet/pluginmanager) with its own
// DRA manager (pkg/kubelet/cm/dra) as the plugin handler, and DRA drivers built on the kubelet
// plugin helper of k8s.io/dynamic-resource-allocation (kubeletplugin), each subcommand a process
// of its own driven over stdin/stdout.
//
//	realdra kubelet --registry DIR --state DIR [--kubelet-socket PATH] [--node NAME] [-v 4]
//	realdra driver --name DRIVER --registry DIR --plugin-dir DIR [--reg-socket FILE] [--rolling-uid UID] [--health off|unsupported|v1]
//	realdra vectors  (the kubelet types' wire bytes, for tests/test_dra_proto.py)
//	realdra version
//
// Commands arrive one a line on stdin: words separated by blanks, optionally led by "@ID";
// every command is answered by exactly one JSON line {"ok":true|false,"cmd":...,"id":ID,...}.
// Asynchronous events are JSON lines {"event":NAME,...}. klog writes to stderr.
package main

import (
	"fmt"

	"hami-guard/tests/fixturekit"
)

func main() {
	fixturekit.Main("usage: realdra kubelet|driver|version [flags]", map[string]func(args []string) int{
		"kubelet": kubeletMain,
		"driver":  driverMain,
		"vectors": func([]string) int { return vectorsMain() },
		"version": func([]string) int {
			fmt.Println(kubernetesRelease)
			return 0
		},
	})
}
