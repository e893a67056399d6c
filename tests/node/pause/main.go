// Command pause is the node's pod sandbox: it holds the pod's namespaces and waits for a signal,
// reaping the children it is given as PID 1 of a shared PID namespace.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	children := make(chan os.Signal, 1)
	signal.Notify(children, syscall.SIGCHLD)
	for {
		select {
		case <-stop:
			os.Exit(0)
		case <-children:
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
		}
	}
}
