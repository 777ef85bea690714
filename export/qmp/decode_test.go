package qmp

import (
	"bufio"
	"bytes"
	"encoding/json"
	"testing"
)

// FuzzQMPInput runs what a client sends through everything before the
// engine: the stream split, the JSON, the message's members and the
// arguments of the commands that take the most. None may panic, and an
// error must come as QEMU's class with a description.
func FuzzQMPInput(f *testing.F) {
	for _, s := range []string{
		`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "q", "file": {"driver": "file", "filename": "/x"}}}`,
		`{"execute": "block-export-add", "arguments": {"type": "fuse", "id": "e", "node-name": "q", "mountpoint": "/m", "writable": true}}`,
		`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "inet", "data": {"host": "::", "port": "0"}}}}`,
		`[1,2]} {"execute":3}`, `{"id": [{"a": null}], "execute": "x"`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		sc := &scanner{r: bufio.NewReader(bytes.NewReader(in))}
		for {
			msg, err := sc.next()
			if err != nil {
				if err == errTooBig || err == errTooDeep {
					continue
				}
				return
			}
			d := json.NewDecoder(bytes.NewReader(msg))
			d.UseNumber()
			var obj map[string]any
			if d.Decode(&obj) != nil || obj == nil {
				continue
			}
			_, args, _, err := checkInput(obj, true)
			if err != nil {
				continue
			}
			for _, decode := range []func() error{
				func() error { _, err := BlockdevOptions(args, false); return err },
				func() error { _, err := ExportOptions(args, false); return err },
				func() error { _, err := NBDServerOptions(args); return err },
			} {
				if err := decode(); err != nil && err.Error() == "" {
					t.Fatalf("%q: an error without a description", msg)
				}
			}
		}
	})
}
