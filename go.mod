module github.com/blockexport/blockexport

go 1.26.8

require (
	github.com/hanwen/go-fuse/v2 v2.12.1
	github.com/klauspost/compress v1.20.4
	github.com/lima-vm/go-qcow2reader v0.7.1
	github.com/pojntfx/go-nbd v0.3.2
	github.com/spf13/pflag v1.1.0
	golang.org/x/sys v0.50.0
)
