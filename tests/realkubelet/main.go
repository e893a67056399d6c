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

	"hami-guard/tests/fixturekit"
)

func main() {
	fixturekit.Main("usage: realkubelet kubelet|plugin|version [flags]", map[string]func(args []string) int{
		"kubelet":      kubeletMain,
		nsChildCommand: kubeletChildMain,
		"plugin":       pluginMain,
		"version": func([]string) int {
			fmt.Println(kubernetesRelease)
			return 0
		},
	})
}
