package qmp

import (
	"github.com/blockexport/blockexport/export/engine"
)

// BlockdevOptions decodes blockdev-add's arguments (or --blockdev's,
// keyval true: from the command line, scalars as strings).
func BlockdevOptions(m map[string]any, keyval bool) (engine.BlockdevOptions, error) {
	a := newArgs(m, keyval)
	o := blockdev(a)
	return o, a.done()
}

func blockdev(a *args) engine.BlockdevOptions {
	var o engine.BlockdevOptions
	o.Driver = a.enum("driver", true, engine.Drivers()...)
	o.NodeName = a.str("node-name", false)
	o.ReadOnly = a.boolean("read-only")
	o.AutoReadOnly = a.boolean("auto-read-only")
	a.ignore("discard", "force-share", "detect-zeroes")
	if c := a.object("cache", false); c != nil {
		o.CacheDirect = c.boolean("direct")
		// no-flush: flushes are kept here (safer, and cheap on the
		// page cache).
		c.boolean("no-flush")
		c.done()
	}
	switch o.Driver {
	case "nbd":
		if srv := a.object("server", true); srv != nil {
			addr := socketAddress(srv, srv.enum("type", true, "inet", "unix", "vsock", "fd"))
			o.Server = &addr
			srv.done()
		}
		o.Export = a.str("export", false)
		o.TLSCreds = a.str("tls-creds", false)
		o.TLSHostname = a.str("tls-hostname", false)
		o.ReconnectDelay = a.integer("reconnect-delay", false)
		a.ignore("open-timeout")
	case "http", "https", "s3":
		// QEMU's curl keys; username, the secrets and cookies are not
		// served here and stay unexpected. tls-ca, and s3's keys named
		// as the one-shot commands' flags, are our own.
		o.URL = a.str("url", true)
		if ra := a.integer("readahead", false); ra%512 != 0 {
			a.fail("HTTP_READAHEAD_SIZE %d is not a multiple of 512", ra)
		}
		o.Timeout = a.integer("timeout", false)
		o.SSLVerify = true
		if _, ok := a.m["sslverify"]; ok && o.Driver == "https" {
			o.SSLVerify = a.boolean("sslverify")
		}
		o.TLSCA = a.str("tls-ca", false)
		if o.Driver == "s3" {
			o.S3Endpoint = a.str("s3-endpoint", false)
			o.S3PathStyle = a.boolean("s3-path-style")
		}
	case "copy-on-read":
		o.File = blockdevRef(a, "file")
		if _, ok := a.m["bottom"]; ok {
			a.fail("Parameter 'bottom' is not supported here: the filter copies from the whole backing chain")
		}
	case "file":
		o.Filename = a.str("filename", true)
		o.AIO = a.enum("aio", false, "threads", "native", "io_uring")
		a.ignore("locking", "aio-max-batch", "drop-cache", "pr-manager")
	case "null-co":
		o.Size = a.integer("size", false)
		o.ReadZeroes = a.boolean("read-zeroes")
		a.ignore("latency-ns")
	case "":
	default:
		o.File = blockdevRef(a, "file")
		if engine.TakesBacking(o.Driver) {
			// backing: null opens the image alone; a node name puts
			// that node under it (the engine says which it takes).
			if v, ok := a.m["backing"]; ok {
				switch v := v.(type) {
				case nil:
					o.NoBacking = true
				case string:
					o.Backing = v
				case map[string]any:
					a.fail("Parameter 'backing' is given inline here; add the backing node first and name it")
				default:
					a.fail("Invalid parameter type for 'backing', expected: BlockdevRefOrNull")
				}
			}
			a.used["backing"] = true
		}
		a.ignore("offset", "size", "lazy-refcounts", "cache-size", "l2-cache-size", "refcount-cache-size", "cache-clean-interval")
	}
	return o
}

// blockdevRef reads a child: a node name, or an object opened with it.
func blockdevRef(a *args, name string) *engine.BlockdevRef {
	v, ok := a.get(name, true)
	if !ok {
		return nil
	}
	switch v := v.(type) {
	case string:
		return &engine.BlockdevRef{Name: v}
	case map[string]any:
		sub := a.object(name, true)
		inline := blockdev(sub)
		sub.done()
		return &engine.BlockdevRef{Inline: &inline}
	}
	a.fail("Invalid parameter type for '%s%s', expected: BlockdevRef", a.prefix, name)
	return nil
}

// ExportOptions decodes block-export-add's arguments (or --export's).
func ExportOptions(m map[string]any, keyval bool) (engine.ExportOptions, error) {
	a := newArgs(m, keyval)
	var o engine.ExportOptions
	o.Type = a.enum("type", true, "nbd", "fuse", "vhost-user-blk", "vduse-blk")
	o.ID = a.str("id", true)
	a.ignore("fixed-iothread", "iothread")
	o.NodeName = a.str("node-name", true)
	o.Writable = a.boolean("writable")
	a.ignore("writethrough")
	switch o.Type {
	case "fuse":
		o.Mountpoint = a.str("mountpoint", true)
		o.Growable = a.boolean("growable")
		o.AllowOther = a.enum("allow-other", false, "off", "on", "auto")
	case "nbd":
		o.Name = a.optStr("name")
		o.Description = a.str("description", false)
		o.Bitmaps = a.strList("bitmaps")
		a.ignore("allocation-depth")
	case "vhost-user-blk", "vduse-blk":
		a.fail("Parameter 'type' does not accept value '%s'", o.Type) // not served here
	}
	return o, a.done()
}

// NBDServerOptions decodes nbd-server-start's arguments: addr is
// SocketAddressLegacy ({"type": "unix", "data": {"path": ...}}).
func NBDServerOptions(m map[string]any) (engine.NBDServerOptions, error) {
	a := newArgs(m, false)
	var o engine.NBDServerOptions
	if addr := a.object("addr", true); addr != nil {
		o.Addr.Type = addr.enum("type", true, "inet", "unix", "vsock", "fd")
		if data := addr.object("data", true); data != nil {
			o.Addr = socketAddress(data, o.Addr.Type)
			data.done()
		}
		addr.done()
	}
	nbdServerRest(a, &o)
	return o, a.done()
}

// nbdServerRest reads the members after addr, common to both forms.
func nbdServerRest(a *args, o *engine.NBDServerOptions) {
	o.TLSCreds = a.str("tls-creds", false)
	o.TLSAuthz = a.str("tls-authz", false)
	o.MaxConnections = int(a.integer("max-connections", false))
}

// TLSCredsOptions decodes object-add's and --object's members. The only
// type served is tls-creds-x509; any other is refused as QEMU refuses a
// type it does not know.
func TLSCredsOptions(m map[string]any, keyval bool) (engine.TLSCredsOptions, error) {
	a := newArgs(m, keyval)
	a.enum("qom-type", true, "tls-creds-x509")
	o := engine.TLSCredsOptions{ID: a.str("id", true), Dir: a.str("dir", false), VerifyPeer: true}
	if o.Endpoint = a.enum("endpoint", false, "client", "server"); o.Endpoint == "" {
		o.Endpoint = "client"
	}
	if _, ok := m["verify-peer"]; ok {
		o.VerifyPeer = a.boolean("verify-peer")
	}
	a.ignore("sanity-check")
	return o, a.done()
}

// NBDServerFlat decodes --nbd-server's keys: addr is the flat
// SocketAddress (addr.type=unix,addr.path=...).
func NBDServerFlat(m map[string]any) (engine.NBDServerOptions, error) {
	a := newArgs(m, true)
	var o engine.NBDServerOptions
	if addr := a.object("addr", true); addr != nil {
		o.Addr = socketAddress(addr, addr.enum("type", true, "inet", "unix", "vsock", "fd"))
		addr.done()
	}
	nbdServerRest(a, &o)
	return o, a.done()
}

func socketAddress(a *args, typ string) engine.NBDAddress {
	addr := engine.NBDAddress{Type: typ}
	switch typ {
	case "unix":
		addr.Path = a.str("path", true)
		a.ignore("abstract", "tight")
	case "inet":
		addr.Host = a.str("host", true)
		addr.Port = a.str("port", true)
		a.ignore("numeric", "to", "ipv4", "ipv6", "keep-alive")
	case "vsock", "fd":
		a.fail("Parameter 'type' does not accept value '%s'", typ)
	}
	return addr
}
