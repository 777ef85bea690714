package qmp

import (
	"bufio"
	"bytes"
	"encoding/json"
	"testing"

	"github.com/blockexport/blockexport/export/engine"
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
		`{"execute": "object-add", "arguments": {"qom-type": "tls-creds-x509", "id": "t", "dir": "/d", "endpoint": "server", "verify-peer": false}}`,
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
				func() error { _, err := TLSCredsOptions(args, false); return err },
			} {
				if err := decode(); err != nil && err.Error() == "" {
					t.Fatalf("%q: an error without a description", msg)
				}
			}
		}
	})
}

// TestTLSCredsOptionsTakeQEMUsDefaults: endpoint client and verify-peer
// on when absent, verify-peer=off from keyval, and other qom-types and
// other members refused in QEMU's words.
func TestTLSCredsOptionsTakeQEMUsDefaults(t *testing.T) {
	for _, tc := range []struct {
		opt      string
		want     engine.TLSCredsOptions
		wantDesc string
	}{
		{opt: "tls-creds-x509,id=t,dir=/d", want: engine.TLSCredsOptions{ID: "t", Dir: "/d", Endpoint: "client", VerifyPeer: true}},
		{opt: "tls-creds-x509,id=t,dir=/d,endpoint=server,verify-peer=off", want: engine.TLSCredsOptions{ID: "t", Dir: "/d", Endpoint: "server"}},
		{opt: "secret,id=s,data=x", wantDesc: "Parameter 'qom-type' does not accept value 'secret'"},
		{opt: "tls-creds-x509,id=t,dir=/d,verify-peer=maybe", wantDesc: "Parameter 'verify-peer' expects 'on' or 'off'"},
		{opt: "tls-creds-x509,id=t,dir=/d,colour=red", wantDesc: "Parameter 'colour' is unexpected"},
	} {
		m, keyval, err := ParseOption(tc.opt, "qom-type")
		if err != nil {
			t.Fatalf("%s: %v", tc.opt, err)
		}
		got, err := TLSCredsOptions(m, keyval)
		if tc.wantDesc != "" {
			if err == nil || err.Error() != tc.wantDesc {
				t.Errorf("%s: %v, want %q", tc.opt, err, tc.wantDesc)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s: %+v, %v; want %+v", tc.opt, got, err, tc.want)
		}
	}
}
