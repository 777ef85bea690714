module github.com/blockexport/blockexport

go 1.26.8

require (
	github.com/hanwen/go-fuse/v2 v2.12.1 // indirect
	github.com/klauspost/compress v1.20.4 // indirect
	github.com/lima-vm/go-qcow2reader v0.7.1 // indirect
	github.com/pojntfx/go-nbd v0.3.2 // indirect
	github.com/spf13/pflag v1.1.0 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
