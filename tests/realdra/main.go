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
	"os"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: realdra kubelet|driver|version [flags]")
		os.Exit(2)
	}
	var code int
	switch os.Args[1] {
	case "kubelet":
		code = kubeletMain(os.Args[2:])
	case "driver":
		code = driverMain(os.Args[2:])
	case "vectors":
		code = vectorsMain()
	case "version":
		fmt.Println(kubernetesRelease)
	default:
		fmt.Fprintf(os.Stderr, "unknown subcommand %q\n", os.Args[1])
		code = 2
	}
	os.Exit(code)
}
