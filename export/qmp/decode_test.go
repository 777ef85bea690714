package qmp

import (
	"bufio"
	"bytes"
	"encoding/json"
	"strings"
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
		`{"execute": "blockdev-add", "arguments": {"driver": "nbd", "node-name": "n", "server": {"type": "unix", "path": "/s"}, "export": "e", "reconnect-delay": 5}}`,
		`{"execute": "blockdev-add", "arguments": {"driver": "raw", "node-name": "r", "read-only": true, "file": {"driver": "https", "url": "https://h/x", "sslverify": true}}}`,
		`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e", "node-name": "q", "bitmaps": ["a", "b"]}}`,
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

// TestRemoteDriverKeysAsQEMUNamesThem: nbd's server (flat
// SocketAddress), export and reconnect-delay, curl's url, readahead and
// timeout, https's sslverify, s3's keys named as the one-shot flags,
// copy-on-read's file, and an NBD export's bitmaps from a JSON array or
// keyval's numbered members; mistakes refused in QEMU's words.
func TestRemoteDriverKeysAsQEMUNamesThem(t *testing.T) {
	for _, tc := range []struct {
		opt      string
		check    func(engine.BlockdevOptions) bool
		wantDesc string
	}{
		{opt: "driver=nbd,node-name=n,server.type=unix,server.path=/s,export=e,reconnect-delay=5,tls-creds=c",
			check: func(o engine.BlockdevOptions) bool {
				return o.Server != nil && *o.Server == engine.NBDAddress{Type: "unix", Path: "/s"} && o.Export == "e" && o.ReconnectDelay == 5 && o.TLSCreds == "c"
			}},
		{opt: "driver=nbd,node-name=n,server.type=inet,server.host=127.0.0.1,server.port=10809",
			check: func(o engine.BlockdevOptions) bool {
				return o.Server != nil && o.Server.Host == "127.0.0.1" && o.Server.Port == "10809" && o.Export == ""
			}},
		{opt: "driver=nbd,node-name=n", wantDesc: "Parameter 'server' is missing"},
		{opt: "driver=http,node-name=h,url=http://h/x,read-only=on,readahead=65536,timeout=10",
			check: func(o engine.BlockdevOptions) bool {
				return o.URL == "http://h/x" && o.Timeout == 10 && o.ReadOnly && o.SSLVerify
			}},
		{opt: "driver=http,node-name=h,url=http://h/x,readahead=1000", wantDesc: "HTTP_READAHEAD_SIZE 1000 is not a multiple of 512"},
		{opt: "driver=http,node-name=h,url=http://h/x,sslverify=off", wantDesc: "Parameter 'sslverify' is unexpected"},
		{opt: "driver=https,node-name=h,url=https://h/x,sslverify=off,tls-ca=/ca.pem",
			check: func(o engine.BlockdevOptions) bool { return !o.SSLVerify && o.TLSCA == "/ca.pem" }},
		{opt: "driver=s3,node-name=s,url=s3://b/k,s3-endpoint=http://127.0.0.1:7070,s3-path-style=on",
			check: func(o engine.BlockdevOptions) bool {
				return o.URL == "s3://b/k" && o.S3Endpoint == "http://127.0.0.1:7070" && o.S3PathStyle
			}},
		{opt: "driver=copy-on-read,node-name=c,file=top",
			check: func(o engine.BlockdevOptions) bool { return o.File != nil && o.File.Name == "top" }},
		{opt: "driver=copy-on-read,node-name=c,file=top,bottom=base", wantDesc: "Parameter 'bottom' is not supported here: the filter copies from the whole backing chain"},
	} {
		checkBlockdevOption(t, tc.opt, tc.check, tc.wantDesc)
	}
	for _, tc := range []struct {
		opt      string
		want     []string
		wantDesc string
	}{
		{opt: "nbd,id=e,node-name=q,bitmaps.0=a,bitmaps.1=b", want: []string{"a", "b"}},
		{opt: `{"type": "nbd", "id": "e", "node-name": "q", "bitmaps": ["b", "a"]}`, want: []string{"b", "a"}},
		{opt: "nbd,id=e,node-name=q,bitmaps=a", wantDesc: "Invalid parameter type for 'bitmaps', expected: array"},
		{opt: "nbd,id=e,node-name=q,bitmaps.1=a", wantDesc: "Parameter 'bitmaps.0' is missing"},
		{opt: `{"type": "nbd", "id": "e", "node-name": "q", "bitmaps": [1]}`, wantDesc: "Invalid parameter type for 'bitmaps[0]', expected: string"},
	} {
		m, keyval, err := ParseOption(tc.opt, "type")
		if err != nil {
			t.Fatalf("%s: %v", tc.opt, err)
		}
		got, err := ExportOptions(m, keyval)
		if tc.wantDesc != "" {
			if err == nil || err.Error() != tc.wantDesc {
				t.Errorf("%s: %v, want %q", tc.opt, err, tc.wantDesc)
			}
			continue
		}
		if err != nil || strings.Join(got.Bitmaps, ",") != strings.Join(tc.want, ",") {
			t.Errorf("%s: %q, %v; want %q", tc.opt, got.Bitmaps, err, tc.want)
		}
	}
}

// TestBackingOptionAsQEMUTakesIt: a format node's backing is null (the
// image alone), a node's name, or refused: inline (not taken here) and
// any other type in QEMU's words; a driver without backing files has no
// such key.
func TestBackingOptionAsQEMUTakesIt(t *testing.T) {
	for _, tc := range []struct {
		opt      string
		check    func(engine.BlockdevOptions) bool
		wantDesc string
	}{
		{opt: `{"driver": "qcow2", "node-name": "o", "file": "f", "backing": null}`,
			check: func(o engine.BlockdevOptions) bool { return o.NoBacking && o.Backing == "" }},
		{opt: `{"driver": "qcow2", "node-name": "o", "file": "f", "backing": "base"}`,
			check: func(o engine.BlockdevOptions) bool { return !o.NoBacking && o.Backing == "base" }},
		{opt: "driver=qcow2,node-name=o,file=f,backing=base",
			check: func(o engine.BlockdevOptions) bool { return o.Backing == "base" }},
		{opt: `{"driver": "qcow2", "node-name": "o", "file": "f"}`,
			check: func(o engine.BlockdevOptions) bool { return !o.NoBacking && o.Backing == "" }},
		{opt: `{"driver": "qcow2", "node-name": "o", "file": "f", "backing": 5}`,
			wantDesc: "Invalid parameter type for 'backing', expected: BlockdevRefOrNull"},
		{opt: `{"driver": "qcow2", "node-name": "o", "file": "f", "backing": {"driver": "null-co"}}`,
			wantDesc: "Parameter 'backing' is given inline here; add the backing node first and name it"},
		{opt: `{"driver": "raw", "node-name": "o", "file": "f", "backing": "base"}`,
			wantDesc: "Parameter 'backing' is unexpected"},
	} {
		checkBlockdevOption(t, tc.opt, tc.check, tc.wantDesc)
	}
}

// checkBlockdevOption parses opt (keyval or JSON) as --blockdev does and
// wants check to hold of the options, or, with wantDesc, that error.
func checkBlockdevOption(t *testing.T, opt string, check func(engine.BlockdevOptions) bool, wantDesc string) {
	t.Helper()
	m, keyval, err := ParseOption(opt, "")
	if err != nil {
		t.Fatalf("%s: %v", opt, err)
	}
	got, err := BlockdevOptions(m, keyval)
	if wantDesc != "" {
		if err == nil || err.Error() != wantDesc {
			t.Errorf("%s: %v, want %q", opt, err, wantDesc)
		}
		return
	}
	if err != nil || !check(got) {
		t.Errorf("%s: %+v, %v", opt, got, err)
	}
}
