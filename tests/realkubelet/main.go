// Command realkubelet runs the kubelet's own device manager and device plugins built on the
// kubelet's own API types, each subcommand a process of its own driven over stdin/stdout.
//
//	realkubelet kubelet --dir DIR --pod-resources SOCK [--capacity-interval 10s]
//	realkubelet plugin --dir DIR --socket NAME --resource RES [--devices ID[@numa[,numa]]]... [ID...]
//	realkubelet version
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
		fmt.Fprintln(os.Stderr, "usage: realkubelet kubelet|plugin|version [flags]")
		os.Exit(2)
	}
	var code int
	switch os.Args[1] {
	case "kubelet":
		code = kubeletMain(os.Args[2:])
	case nsChildCommand:
		code = kubeletChildMain(os.Args[2:])
	case "plugin":
		code = pluginMain(os.Args[2:])
	case "version":
		fmt.Println(kubernetesRelease)
	default:
		fmt.Fprintf(os.Stderr, "unknown subcommand %q\n", os.Args[1])
		code = 2
	}
	os.Exit(code)
}
