package fixturekit

import (
	"fmt"
	"os"
)

// Main runs the subcommand os.Args[1] names with the arguments after it and exits with its code;
// without one it prints usage, for an unknown one its name, and exits 2.
func Main(usage string, subcommands map[string]func(args []string) int) {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	code := 2
	if run, ok := subcommands[os.Args[1]]; ok {
		code = run(os.Args[2:])
	} else {
		fmt.Fprintf(os.Stderr, "unknown subcommand %q\n", os.Args[1])
	}
	os.Exit(code)
}

// SourcesReady is the kubelet's config.SourcesReady for a fixture: its pod sources are all ready
// (steady state).
type SourcesReady struct{}

func (SourcesReady) AddSource(string) {}
func (SourcesReady) AllReady() bool   { return true }
