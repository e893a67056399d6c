package fixturekit

import (
	"bytes"
	"flag"
	"os"
	"strings"

	"k8s.io/klog/v2"
)

// SetupKlog sends klog to stderr and turns each log line into a "log" event (the kubelet's own
// words), so a driver can wait for what the kubelet logged ("Device plugin connected", ...).
func SetupKlog(verbosity string) {
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	_ = fs.Set("v", verbosity)
	_ = fs.Set("logtostderr", "false")
	_ = fs.Set("alsologtostderr", "false")
	_ = fs.Set("stderrthreshold", "FATAL")
	klog.SetOutput(klogTee{})
}

type klogTee struct{}

func (klogTee) Write(p []byte) (int, error) {
	_, _ = os.Stderr.Write(p)
	for _, line := range bytes.Split(bytes.TrimRight(p, "\n"), []byte("\n")) {
		s := string(line)
		i := strings.Index(s, "] \"")
		if i < 0 {
			continue
		}
		msg := s[i+3:]
		if j := strings.Index(msg, "\""); j >= 0 {
			msg = msg[:j]
		}
		Event("log", map[string]any{"msg": msg, "line": strings.TrimSpace(s[i+2:])})
	}
	return len(p), nil
}
