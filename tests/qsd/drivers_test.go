package qsd

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// session is one QMP conversation whose messages are kept, normalised
// (each path in repl replaced by its name), to compare one daemon's
// answers with another's.
type session struct {
	t    *testing.T
	c    *rawClient
	repl map[string]string
	msgs []string
}

func newSession(t *testing.T, d *daemon, repl map[string]string) *session {
	t.Helper()
	s := &session{t: t, c: dialRaw(t, d.sock, false), repl: repl}
	s.send(`{"execute": "qmp_capabilities"}`)
	return s
}

func (s *session) normalise(m string) string {
	for path, name := range s.repl {
		m = strings.ReplaceAll(m, path, name)
	}
	return m
}

// send records cmd's messages (its events and reply) whole.
func (s *session) send(cmd string) {
	s.t.Helper()
	for _, m := range s.c.exchange(cmd) {
		s.msgs = append(s.msgs, s.normalise(m))
	}
}

// sendClass records only what kind of answer cmd got (a return, or an
// error's class), where the two daemons word a failure each their own
// way (a library's message, as curl's).
func (s *session) sendClass(cmd string) {
	s.t.Helper()
	r := s.c.call(cmd)
	kind := "return"
	if e, ok := r["error"].(map[string]any); ok {
		kind = fmt.Sprint("error ", e["class"])
	}
	s.msgs = append(s.msgs, s.normalise(cmd)+" -> "+kind)
}

// quit ends the session and wants the daemon to exit 0.
func (s *session) quit(d *daemon) []string {
	s.t.Helper()
	s.send(`{"execute": "quit"}`)
	if code := d.wait(s.t); code != 0 {
		s.t.Fatalf("exit %d after quit\n%s", code, d.log)
	}
	return s.msgs
}

// sameMessages wants ours to be QSD's, message by message.
func sameMessages(t *testing.T, qsd, ours []string) {
	t.Helper()
	if len(qsd) != len(ours) {
		t.Fatalf("QSD sent %d messages, we sent %d:\nQSD:\n%s\nours:\n%s", len(qsd), len(ours),
			strings.Join(qsd, "\n"), strings.Join(ours, "\n"))
	}
	for i := range qsd {
		if qsd[i] != ours[i] {
			t.Errorf("message %d:\n QSD: %s\nours: %s", i, qsd[i], ours[i])
		}
	}
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// TestNBDDriverAnswersAsQSD: an nbd node on another server's export
// (unix socket, export name, reconnect-delay), raw over it, exported
// writable over the daemon's own NBD server: reads and writes reach the
// source, and every answer, a server that is not there included, is
// QSD's.
func TestNBDDriverAnswersAsQSD(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", src, "4M")
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x5a 0 1M", src)
	srcSock := filepath.Join(dir, "src.sock")
	harness.StartServerProc(t, srcSock, "qemu-nbd", "-t", "-e", "4", "-f", "raw", "-x", "src", "-k", srcSock, src)
	qsd := runNBDDriverScript(t, "qemu-storage-daemon", srcSock, 0x66)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "read -P 0x66 2M 64k", harness.NBDURI("src", srcSock))
	ours := runNBDDriverScript(t, harness.Bin, srcSock, 0x67)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "read -P 0x67 2M 64k", harness.NBDURI("src", srcSock))
	sameMessages(t, qsd, ours)
}

func runNBDDriverScript(t *testing.T, prog, srcSock string, pattern byte) []string {
	t.Helper()
	dir := t.TempDir()
	nbdSock := filepath.Join(dir, "nbd.sock")
	d := startDaemon(t, prog, nil)
	s := newSession(t, d, map[string]string{dir: "$DIR", srcSock: "$SRC"})
	s.send(`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}}}`)
	s.send(`{"execute": "blockdev-add", "arguments": {"driver": "nbd", "node-name": "gone", "server": {"type": "unix", "path": "` + dir + `/none.sock"}}}`)
	s.send(`{"execute": "blockdev-add", "arguments": {"driver": "nbd", "node-name": "src", "server": {"type": "unix", "path": "` + srcSock + `"}, "export": "src", "reconnect-delay": 5}}`)
	s.send(`{"execute": "blockdev-add", "arguments": {"driver": "raw", "node-name": "disk", "file": "src"}}`)
	s.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e", "node-name": "disk", "writable": true}}`)
	s.send(`{"execute": "query-block-exports"}`)
	uri := harness.NBDURI("disk", nbdSock)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "read -P 0x5a 0 1M", "-c", "read -P 0 1M 1M",
		"-c", fmt.Sprintf("write -P %#x 2M 64k", pattern), uri)
	s.send(`{"execute": "block-export-del", "arguments": {"id": "e"}}`)
	s.send(`{"execute": "blockdev-del", "arguments": {"node-name": "disk"}}`)
	s.send(`{"execute": "blockdev-del", "arguments": {"node-name": "src"}}`)
	return s.quit(d)
}

// TestHTTPDriversAnswerAsQSD: http nodes as QEMU's curl driver takes
// them (url, readahead, timeout; read-only required; https wants an
// https URL), a raw object and a qcow2 image over an inline http child
// that inherits read-only, both exported over NBD and read whole; the
// answers are QSD's, a missing object's error class included.
func TestHTTPDriversAnswerAsQSD(t *testing.T) {
	dir := t.TempDir()
	raw := filepath.Join(dir, "disk.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", raw, "4M")
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x3c 64k 1M", "-c", "write -P 0xc3 3M 4k", raw)
	qcow := filepath.Join(dir, "disk.qcow2")
	harness.Run(t, "qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", raw, qcow)
	web := harness.StartNginx(t)
	web.Put(t, "disk.raw", raw)
	web.Put(t, "disk.qcow2", qcow)
	qsd := runHTTPScript(t, "qemu-storage-daemon", web, raw, "")
	ours := runHTTPScript(t, harness.Bin, web, raw, "")
	sameMessages(t, qsd, ours)
	// https with sslverify=off (the server's certificate is signed by
	// the test CA, which neither daemon trusts): the same on both.
	sameMessages(t, runHTTPScript(t, "qemu-storage-daemon", web, raw, "off"), runHTTPScript(t, harness.Bin, web, raw, "off"))
	// https with the test CA: our own tls-ca key (QSD's curl takes the
	// system's roots only).
	runHTTPScript(t, harness.Bin, web, raw, web.CA)
}

// TestHTTPSDriverVerifiesTheServerByDefault: an https node of a server
// whose certificate no trusted CA signed is refused by both daemons
// unless sslverify=off; the failure leaves no node behind.
func TestHTTPSDriverVerifiesTheServerByDefault(t *testing.T) {
	dir := t.TempDir()
	raw := filepath.Join(dir, "disk.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", raw, "1M")
	web := harness.StartNginx(t)
	web.Put(t, "disk.raw", raw)
	var msgs [][]string
	for _, prog := range []string{"qemu-storage-daemon", harness.Bin} {
		d := startDaemon(t, prog, nil)
		s := newSession(t, d, map[string]string{web.HTTPS: "$HTTPS"})
		s.sendClass(`{"execute": "blockdev-add", "arguments": {"driver": "https", "node-name": "s", "read-only": true, "url": "` + web.URL("https", "disk.raw") + `"}}`)
		s.send(`{"execute": "blockdev-add", "arguments": {"driver": "https", "node-name": "s", "read-only": true, "sslverify": false, "url": "` + web.URL("https", "disk.raw") + `"}}`)
		s.send(`{"execute": "blockdev-del", "arguments": {"node-name": "s"}}`)
		msgs = append(msgs, s.quit(d))
	}
	sameMessages(t, msgs[0], msgs[1])
	if refused := msgs[1][1]; !strings.HasSuffix(refused, "-> error GenericError") {
		t.Errorf("an https node of an untrusted server: %s, want a GenericError", refused)
	}
}

// runHTTPScript runs the http script; with ca "off" an https one with
// sslverify=off, with a CA file an https one against our daemon alone.
func runHTTPScript(t *testing.T, prog string, web *harness.Nginx, raw, ca string) []string {
	t.Helper()
	dir := t.TempDir()
	nbdSock := filepath.Join(dir, "nbd.sock")
	d := startDaemon(t, prog, nil)
	s := newSession(t, d, map[string]string{dir: "$DIR", web.HTTP: "$HTTP", web.HTTPS: "$HTTPS"})
	scheme, extra := "http", `, "readahead": 65536, "timeout": 10`
	switch ca {
	case "":
	case "off":
		scheme, extra = "https", `, "sslverify": false`
	default:
		scheme, extra = "https", `, "tls-ca": `+jsonString(ca)
	}
	rawURL, qcowURL := web.URL(scheme, "disk.raw"), web.URL(scheme, "disk.qcow2")
	if ca == "" {
		s.send(`{"execute": "blockdev-add", "arguments": {"driver": "http", "node-name": "w", "url": "` + rawURL + `"}}`)
		s.send(`{"execute": "blockdev-add", "arguments": {"driver": "https", "node-name": "s", "url": "` + rawURL + `", "read-only": true}}`)
		s.sendClass(`{"execute": "blockdev-add", "arguments": {"driver": "http", "node-name": "gone", "url": "` + web.URL(scheme, "none.raw") + `", "read-only": true}}`)
	}
	s.send(`{"execute": "blockdev-add", "arguments": {"driver": "` + scheme + `", "node-name": "raw", "url": "` + rawURL + `", "read-only": true` + extra + `}}`)
	s.send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "q", "read-only": true, "file": {"driver": "` + scheme + `", "url": "` + qcowURL + `"` + extra + `}}}`)
	s.send(`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}}}`)
	s.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "er", "node-name": "raw"}}`)
	s.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "eq", "node-name": "q"}}`)
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", raw, harness.NBDURI("raw", nbdSock))
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", raw, harness.NBDURI("q", nbdSock))
	s.send(`{"execute": "block-export-del", "arguments": {"id": "er"}}`)
	s.send(`{"execute": "block-export-del", "arguments": {"id": "eq"}}`)
	s.send(`{"execute": "blockdev-del", "arguments": {"node-name": "q"}}`)
	s.send(`{"execute": "blockdev-del", "arguments": {"node-name": "raw"}}`)
	return s.quit(d)
}

// mapEntry is one row of qemu-img map --output=json without the host
// offset, which differs between two writers of the same data.
type mapEntry struct {
	Start  int64 `json:"start"`
	Length int64 `json:"length"`
	Depth  int   `json:"depth"`
	Zero   bool  `json:"zero"`
	Data   bool  `json:"data"`
}

func imageMap(t *testing.T, img string) []mapEntry {
	t.Helper()
	var m []mapEntry
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "map", "--output=json", "-f", "qcow2", img)), &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestCopyOnReadDriverCopiesAsQSD: a copy-on-read node over a qcow2
// overlay, exported over NBD and read in part, leaves the overlay with
// what was read copied up from its backing file and nothing else, as
// QSD's filter leaves it; the answers are QSD's.
func TestCopyOnReadDriverCopiesAsQSD(t *testing.T) {
	base := t.TempDir()
	backing := filepath.Join(base, "base.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", backing, "8M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x33 0 2M", "-c", "write -P 0x44 4M 1M", backing)
	qsdMsgs, qsdTop := runCopyOnReadScript(t, "qemu-storage-daemon", backing)
	ourMsgs, ourTop := runCopyOnReadScript(t, harness.Bin, backing)
	sameMessages(t, qsdMsgs, ourMsgs)
	qsdMap, ourMap := imageMap(t, qsdTop), imageMap(t, ourTop)
	if fmt.Sprint(qsdMap) != fmt.Sprint(ourMap) {
		t.Fatalf("the overlay after the reads:\n QSD: %v\nours: %v", qsdMap, ourMap)
	}
	// What was read (1 MiB at 512 KiB) is the overlay's own now; the
	// rest of the backing file's data is not.
	copied := false
	for _, e := range ourMap {
		if e.Depth == 0 && e.Data {
			copied = true
			if e.Start > 512<<10 || e.Start+e.Length < 1536<<10 || e.Start+e.Length > 2<<20 {
				t.Errorf("the overlay holds [%d, +%d), want what covers [512K, 1536K) only", e.Start, e.Length)
			}
		}
	}
	if !copied {
		t.Fatalf("nothing was copied into the overlay: %v", ourMap)
	}
	harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "qcow2", backing, ourTop)
	harness.Run(t, "qemu-img", "check", ourTop)
}

func runCopyOnReadScript(t *testing.T, prog, backing string) ([]string, string) {
	t.Helper()
	dir := t.TempDir()
	top := filepath.Join(dir, "top.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", backing, "-F", "qcow2", top)
	nbdSock := filepath.Join(dir, "nbd.sock")
	d := startDaemon(t, prog, nil)
	s := newSession(t, d, map[string]string{dir: "$DIR", backing: "$BASE"})
	s.send(`{"execute": "blockdev-add", "arguments": {"driver": "copy-on-read", "node-name": "nothing", "file": "none"}}`)
	s.send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "top", "file": {"driver": "file", "filename": "` + top + `"}}}`)
	s.send(`{"execute": "blockdev-add", "arguments": {"driver": "copy-on-read", "node-name": "cor", "file": "top"}}`)
	s.send(`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}}}`)
	s.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e", "node-name": "cor"}}`)
	harness.Run(t, "qemu-io", "-f", "raw", "-r", "-c", "read -P 0x33 512k 1M", harness.NBDURI("cor", nbdSock))
	s.send(`{"execute": "blockdev-del", "arguments": {"node-name": "top"}}`)
	s.send(`{"execute": "block-export-del", "arguments": {"id": "e"}}`)
	s.send(`{"execute": "blockdev-del", "arguments": {"node-name": "cor"}}`)
	s.send(`{"execute": "blockdev-del", "arguments": {"node-name": "top"}}`)
	return s.quit(d), top
}

// TestS3DriverServesAnObject: our own s3 driver (url, and s3-endpoint
// and s3-path-style named as the one-shot commands' flags) under a
// qcow2 node, given on the command line, exported over NBD: it reads
// what was uploaded; a writable s3 node is refused.
func TestS3DriverServesAnObject(t *testing.T) {
	srv := harness.StartS3Server(t)
	dir := t.TempDir()
	raw := filepath.Join(dir, "disk.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", raw, "4M")
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x5e 1M 1M", raw)
	qcow := filepath.Join(dir, "disk.qcow2")
	harness.Run(t, "qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", raw, qcow)
	srv.Put("disk.qcow2", qcow)
	nbdSock := filepath.Join(dir, "nbd.sock")
	d := startDaemon(t, harness.Bin, nil,
		"--blockdev", "driver=qcow2,node-name=q,read-only=on,file.driver=s3,file.url="+srv.URL("disk.qcow2")+
			",file.s3-endpoint="+srv.Endpoint+",file.s3-path-style=on",
		"--nbd-server", "addr.type=unix,addr.path="+nbdSock,
		"--export", "type=nbd,id=e,node-name=q")
	c := dialRaw(t, d.sock, true) // its greeting comes once every option is acted on
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", raw, harness.NBDURI("q", nbdSock))
	wantError(t, "a writable s3 node", c.call(`{"execute": "blockdev-add", "arguments": {"driver": "s3", "node-name": "w", "url": "`+
		srv.URL("disk.qcow2")+`", "s3-endpoint": "`+srv.Endpoint+`"}}`), "GenericError", "s3 driver does not support writes")
	nodes := string(mustJSON(c.call(`{"execute": "query-named-block-nodes"}`)["return"]))
	if !strings.Contains(nodes, `"drv":"s3"`) {
		t.Fatalf("query-named-block-nodes shows no s3 node: %s", nodes)
	}
	harness.MustNotShowS3Secret(t, "query-named-block-nodes", nodes)
	c.call(`{"execute": "quit"}`)
	if code := d.wait(t); code != 0 {
		t.Fatalf("exit %d after quit\n%s", code, d.log)
	}
	harness.MustNotShowS3Secret(t, "the daemon's log", d.log.String())
	if _, err := os.Stat(nbdSock); err == nil {
		t.Error("the NBD socket was left behind")
	}
}

// TestNBDDriverOverTLSAnswersAsQSD: an nbd node whose server wants TLS,
// through a tls-creds-x509 client object (object-add) and tls-hostname;
// credentials that are missing or a server's, and a writable node on a
// read-only export, are refused (auto-read-only takes it read-only), and
// the answers are QSD's; what the node reads is the source's.
func TestNBDDriverOverTLSAnswersAsQSD(t *testing.T) {
	certs := makeCertificateDir(t)
	dir := t.TempDir()
	src := filepath.Join(dir, "src.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", src, "2M")
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x7e 512k 512k", src)
	srcSock := filepath.Join(dir, "src.sock")
	harness.StartServerProc(t, srcSock, "qemu-storage-daemon",
		"--object", "tls-creds-x509,id=s,dir="+certs+",endpoint=server",
		"--blockdev", "driver=file,node-name=disk,filename="+src,
		"--nbd-server", "addr.type=unix,addr.path="+srcSock+",tls-creds=s",
		"--export", "nbd,id=e,node-name=disk,name=src")
	var runs [2][]string
	for i, prog := range []string{"qemu-storage-daemon", harness.Bin} {
		rdir := t.TempDir()
		nbdSock := filepath.Join(rdir, "nbd.sock")
		d := startDaemon(t, prog, nil)
		s := newSession(t, d, map[string]string{rdir: "$DIR", srcSock: "$SRC", certs: "$CERTS"})
		s.send(`{"execute": "object-add", "arguments": {"qom-type": "tls-creds-x509", "id": "c", "dir": "` + certs + `", "endpoint": "client"}}`)
		s.send(`{"execute": "object-add", "arguments": {"qom-type": "tls-creds-x509", "id": "srv", "dir": "` + certs + `", "endpoint": "server"}}`)
		nbdNode := func(name, creds, readOnly string) string {
			return `{"execute": "blockdev-add", "arguments": {"driver": "nbd", "node-name": "` + name + `", "server": {"type": "unix", "path": "` +
				srcSock + `"}, "export": "src", "tls-creds": "` + creds + `", "tls-hostname": "localhost", "read-only": ` + readOnly + `}}`
		}
		s.send(nbdNode("none", "nosuch", "true"))
		s.send(nbdNode("server", "srv", "true"))
		s.send(nbdNode("rw", "c", "false")) // the export is read-only
		s.send(strings.Replace(nbdNode("auto", "c", "false"), `"read-only": false`, `"read-only": false, "auto-read-only": true`, 1))
		s.send(`{"execute": "blockdev-del", "arguments": {"node-name": "auto"}}`)
		s.send(nbdNode("src", "c", "true"))
		s.send(`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}}}`)
		s.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e", "node-name": "src"}}`)
		harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", src, harness.NBDURI("src", nbdSock))
		s.send(`{"execute": "block-export-del", "arguments": {"id": "e"}}`)
		s.send(`{"execute": "blockdev-del", "arguments": {"node-name": "src"}}`)
		runs[i] = s.quit(d)
	}
	sameMessages(t, runs[0], runs[1])
}

// TestNBDDriverReconnectDelayRidesOutAServerRestart: with
// reconnect-delay, a read through an nbd node while its server is down
// waits, and is answered once the server is back, on both daemons.
func TestNBDDriverReconnectDelayRidesOutAServerRestart(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", src, "2M")
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x2b 0 2M", src)
	srcSock := filepath.Join(dir, "src.sock")
	serve := func() *harness.ServerProc {
		return harness.StartServerProc(t, srcSock, "qemu-nbd", "-t", "-e", "4", "-r", "-f", "raw", "-x", "src", "-k", srcSock, src)
	}
	for _, prog := range []string{"qemu-storage-daemon", harness.Bin} {
		t.Run(filepath.Base(prog), func(t *testing.T) {
			server := serve()
			rdir := t.TempDir()
			nbdSock := filepath.Join(rdir, "nbd.sock")
			d := startDaemon(t, prog, nil,
				"--blockdev", "driver=nbd,node-name=src,read-only=on,reconnect-delay=20,server.type=unix,server.path="+srcSock+",export=src",
				"--nbd-server", "addr.type=unix,addr.path="+nbdSock,
				"--export", "type=nbd,id=e,node-name=src,name=src")
			dialRaw(t, d.sock, true)
			harness.Run(t, "qemu-io", "-f", "raw", "-r", "-c", "read -P 0x2b 0 64k", harness.NBDURI("src", nbdSock))
			server.Kill()
			read := make(chan error, 1)
			go func() {
				out, err := exec.Command("qemu-io", "-f", "raw", "-r", "-c", "read -P 0x2b 1M 64k", harness.NBDURI("src", nbdSock)).CombinedOutput()
				if err != nil || strings.Contains(string(out), "failed") || !strings.Contains(string(out), "read 65536/65536") {
					err = fmt.Errorf("%v: %s", err, out)
				}
				read <- err
			}()
			time.Sleep(time.Second)
			select {
			case err := <-read:
				t.Fatalf("a read while the server was down ended before it came back: %v", err)
			default:
			}
			serve()
			select {
			case err := <-read:
				if err != nil {
					t.Fatalf("the read once the server was back: %v\n%s", err, d.log)
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("the read did not end after the server came back\n%s", d.log)
			}
		})
	}
}
