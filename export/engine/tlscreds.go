package engine

import (
	"crypto/tls"
	"os"
	"path/filepath"

	"github.com/blockexport/blockexport/export/nbd"
)

// TLSCredsOptions are a tls-creds-x509 object's properties (object-add,
// --object): a directory of PEM files named as QEMU names them.
type TLSCredsOptions struct {
	ID, Dir  string
	Endpoint string // "server" or "client" (QEMU's default)
	// VerifyPeer (QEMU's default: on) makes a server ask for a client
	// certificate signed by the directory's ca-cert.pem.
	VerifyPeer bool
}

// tlsCreds is a loaded credentials object; a server endpoint's
// configuration is made at object-add, when QEMU loads the files.
type tlsCreds struct {
	o      TLSCredsOptions
	server *tls.Config
}

// AddTLSCreds adds a tls-creds-x509 object, in the order QEMU checks it:
// the id, then the directory and the files in it.
func (e *Engine) AddTLSCreds(o TLSCredsOptions) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.objects[o.ID]; ok {
		return genericf("attempt to add duplicate property '%s' to object (type 'container')", o.ID)
	}
	if o.Dir == "" {
		return genericf("Missing 'dir' property value")
	}
	c := &tlsCreds{o: o}
	required := []string{"ca-cert.pem"}
	if o.Endpoint == "server" {
		required = append(required, "server-cert.pem", "server-key.pem")
	}
	for _, name := range required {
		if _, err := os.Stat(filepath.Join(o.Dir, name)); err != nil {
			return genericf("Unable to access credentials %s: %s", filepath.Join(o.Dir, name), errnoText(err))
		}
	}
	if o.Endpoint == "server" {
		ca := ""
		if o.VerifyPeer {
			ca = filepath.Join(o.Dir, "ca-cert.pem")
		}
		conf, err := nbd.ServerTLSConfig(filepath.Join(o.Dir, "server-cert.pem"), filepath.Join(o.Dir, "server-key.pem"), ca)
		if err != nil {
			return genericf("Unable to load credentials in %s: %v", o.Dir, err)
		}
		c.server = conf
	}
	if e.objects == nil {
		e.objects = map[string]*tlsCreds{}
	}
	e.objects[o.ID] = c
	return nil
}

// DelObject deletes an object (object-del). Credentials an NBD server
// uses are deleted too, as QSD 7.2 deletes them (measured): the server
// keeps its own reference and goes on serving TLS with them.
func (e *Engine) DelObject(id string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.objects[id]; !ok {
		return genericf("object '%s' not found", id)
	}
	delete(e.objects, id)
	return nil
}

// serverTLS is the TLS configuration of nbd-server-start's tls-creds;
// e.mu is held.
func (e *Engine) serverTLS(id string) (*tls.Config, error) {
	c, ok := e.objects[id]
	if !ok {
		return nil, genericf("No TLS credentials with id '%s'", id)
	}
	if c.server == nil {
		return nil, genericf("Expected TLS credentials for a server endpoint")
	}
	return c.server, nil
}
