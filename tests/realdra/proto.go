package main

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

// event writes {"event": name, ...fields}.
func event(name string, fields map[string]any) {
	v := map[string]any{"event": name}
	for k, x := range fields {
		v[k] = x
	}
	stdout.write(v)
}

// command is one line of stdin: an optional "@id", a name and its arguments.
type command struct {
	id   string
	name string
	args []string
}

func parseCommand(line string) (command, bool) {
	words := strings.Fields(line)
	var c command
	if len(words) > 0 && strings.HasPrefix(words[0], "@") {
		c.id = words[0][1:]
		words = words[1:]
	}
	if len(words) == 0 {
		return c, false
	}
	c.name, c.args = words[0], words[1:]
	return c, true
}

// reply answers a command: result fields plus ok (err == nil) or error.
func (c command) reply(fields map[string]any, err error) {
	v := map[string]any{"cmd": c.name, "ok": err == nil}
	if c.id != "" {
		v["id"] = c.id
	}
	for k, x := range fields {
		v[k] = x
	}
	if err != nil {
		v["error"] = err.Error()
	}
	stdout.write(v)
}

// serveCommands reads stdin until EOF or until handle returns true (quit), one command at a time.
// It returns true when stdin closed.
func serveCommands(handle func(command) (quit bool)) bool {
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
