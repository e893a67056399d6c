// Package fixturekit is what the Go fixtures (tests/realkubelet, tests/realdra) share: their
// stdin/stdout protocol, their subcommand dispatch and klog's output turned into events. It
// depends on klog only, so each fixture's modfiles pick their own kubernetes release.
package fixturekit

import (
	"bufio"
	"encoding/json"
	"io"
	"os"
	"strings"
	"sync"
)

// out writes one JSON object a line to stdout; every write is a whole line.
type out struct {
	mu sync.Mutex
	w  io.Writer
}

var stdout = &out{w: os.Stdout}

func (o *out) write(v map[string]any) {
	b, err := json.Marshal(v)
	if err != nil {
		b, _ = json.Marshal(map[string]any{"event": "internal-error", "error": err.Error()})
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	_, _ = o.w.Write(append(b, '\n'))
}

// Event writes {"event": name, ...fields}.
func Event(name string, fields map[string]any) {
	v := map[string]any{"event": name}
	for k, x := range fields {
		v[k] = x
	}
	stdout.write(v)
}

// Command is one line of stdin: an optional "@id", a name and its arguments.
type Command struct {
	ID   string
	Name string
	Args []string
}

func parseCommand(line string) (Command, bool) {
	words := strings.Fields(line)
	var c Command
	if len(words) > 0 && strings.HasPrefix(words[0], "@") {
		c.ID = words[0][1:]
		words = words[1:]
	}
	if len(words) == 0 {
		return c, false
	}
	c.Name, c.Args = words[0], words[1:]
	return c, true
}

// Reply answers a command: result fields plus ok (err == nil) or error.
func (c Command) Reply(fields map[string]any, err error) {
	v := map[string]any{"cmd": c.Name, "ok": err == nil}
	if c.ID != "" {
		v["id"] = c.ID
	}
	for k, x := range fields {
		v[k] = x
	}
	if err != nil {
		v["error"] = err.Error()
	}
	stdout.write(v)
}

// ServeCommands reads stdin until EOF or until handle returns true (quit), one command at a time.
// It returns true when stdin closed.
func ServeCommands(handle func(Command) (quit bool)) bool {
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		c, ok := parseCommand(sc.Text())
		if !ok {
			continue
		}
		if handle(c) {
			return false
		}
	}
	return true
}
