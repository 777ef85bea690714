# blockexport — see README.md.
GO      ?= go
IMAGE   ?= null:1G
MOUNT   ?= /tmp/blockexport.export
FLAGS   ?= --writable

.PHONY: build run test unit fuzz bench man clean

# -buildvcs=auto: stamp the VCS revision (blockexport --version) when built
# from a git checkout, whatever GOFLAGS says.
build:
	# Static (no cgo): nothing here needs libc, and a verb starts sooner
	# (docs/design.md, A verb's start).
	CGO_ENABLED=0 $(GO) build -buildvcs=auto -o bin/blockexport ./cmd/blockexport

# Export IMAGE (default: the built-in 1 GiB null device) at MOUNT in the
# foreground; Ctrl-C unmounts and exits.
run: build
	./bin/blockexport fuse $(FLAGS) $(IMAGE) $(MOUNT)

# The whole suite: unit tests and end-to-end tests with real mounts and
# clients. Installs missing client tools first (as root), and the S3
# server the s3:// tests run (.ci/s3server: a pinned go install, cached
# after the first run). -count=1: the
# end-to-end tests run a binary they build themselves and outside tools,
# which Go's test cache does not see, so a cached pass proves nothing.
# The packages' own tests run under the race detector; the end-to-end
# tests (./tests/...) do not: they drive a blockexport binary built without
# it (BLOCKEXPORT_RACE=1 builds it with it), so the detector would only
# watch the harness, at 2.6x the time (measured on fsx, fio verify and
# the qcow2 kill -9 test). The end-to-end packages run one at a time (-p 1):
# they share the machine's FUSE module parameter, /dev/fuse's mode, the
# test user, loop devices and the page cache.
# The export tests, every test in ./tests/fuse, run a second time with the
# kernel page cache on (--kernel-cache on): a test joins that run by living
# in that package. The fuzzers run
# for a count, not a time: a time limit that ran out while a worker held an
# input was reported as "context deadline exceeded", a failure, in one run.
test:
	.ci/deps
	.ci/s3server
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 20m $$($(GO) list ./... | grep -v '/tests\(/\|$$\)')
	$(GO) test -p 1 -count=1 -timeout 20m ./tests/...
	BLOCKEXPORT_KERNEL_CACHE=on $(GO) test -count=1 -timeout 10m ./tests/fuse
	$(GO) test -run XXX -fuzz FuzzOpen -fuzztime 1500x -fuzzminimizetime 2s ./formats/drivers/qcow2
	$(GO) test -run XXX -fuzz FuzzServe -fuzztime 10000x -fuzzminimizetime 2s ./export/nbd
	$(GO) test -run XXX -fuzz FuzzReplies -fuzztime 30000x -fuzzminimizetime 2s ./formats/protocols/nbd
	$(GO) test -run XXX -fuzz FuzzParse -fuzztime 20000x -fuzzminimizetime 2s ./formats/filters/partition
	$(GO) test -run XXX -fuzz FuzzOpen -fuzztime 2000x -fuzzminimizetime 2s ./formats/drivers/vdi
	$(GO) test -run XXX -fuzz FuzzOpen -fuzztime 2000x -fuzzminimizetime 2s ./formats/drivers/vpc
	$(GO) test -run XXX -fuzz FuzzOpen -fuzztime 1500x -fuzzminimizetime 2s ./formats/drivers/vmdk
	$(GO) test -run XXX -fuzz '^FuzzInflate$$' -fuzztime 50000x -fuzzminimizetime 2s ./formats/internal/inflate
	# Each vhdx input is also written (log, fsyncs): its files go to tmpfs.
	TMPDIR=$$(test -d /dev/shm && echo /dev/shm || echo /tmp) $(GO) test -run XXX -fuzz FuzzOpen -fuzztime 400x -fuzzminimizetime 2s ./formats/drivers/vhdx
	$(GO) test -run XXX -fuzz '^FuzzKernelCacheRequests$$' -fuzztime 3000x -fuzzminimizetime 2s ./export/fuse
	$(GO) test -run XXX -fuzz '^FuzzProbeFormat$$' -fuzztime 5000x -fuzzminimizetime 2s ./formats/registry
	$(GO) test -run XXX -fuzz '^FuzzConvertRanges$$' -fuzztime 2000x -fuzzminimizetime 2s ./formats/jobs/convert
	$(GO) test -run XXX -fuzz '^FuzzDropBacking$$' -fuzztime 300x -fuzzminimizetime 2s ./formats/drivers/qcow2
	$(GO) test -run XXX -fuzz '^FuzzCheck$$' -fuzztime 300x -fuzzminimizetime 2s ./formats/drivers/qcow2
	$(GO) test -run XXX -fuzz '^FuzzAmend$$' -fuzztime 300x -fuzzminimizetime 2s ./formats/drivers/qcow2
	$(GO) test -run XXX -fuzz '^FuzzCheckPartial$$' -fuzztime 5000x -fuzzminimizetime 2s ./formats/protocols/remote/http
	$(GO) test -run XXX -fuzz '^FuzzReadRange$$' -fuzztime 20000x -fuzzminimizetime 2s ./formats/protocols/remote/http
	$(GO) test -run XXX -fuzz '^FuzzParseContentRange$$' -fuzztime 10000x -fuzzminimizetime 2s ./formats/protocols/remote/s3
	$(GO) test -run XXX -fuzz '^FuzzParseURL$$' -fuzztime 10000x -fuzzminimizetime 2s ./formats/protocols/remote/s3
	$(GO) test -run XXX -fuzz '^FuzzKeyval$$' -fuzztime 10000x -fuzzminimizetime 2s ./export/qmp
	$(GO) test -run XXX -fuzz '^FuzzQMPInput$$' -fuzztime 10000x -fuzzminimizetime 2s ./export/qmp

# Every fuzzer for longer (FUZZTIME=10m make fuzz): the image parsers, the NBD
# server and client, the kernel-cache request rules, format probing, the
# convert planner, qcow2 check and drop-backing, the HTTP and S3 reply checks.
FUZZTIME ?= 2m
fuzz:
	$(GO) test -run XXX -fuzz FuzzOpen -fuzztime $(FUZZTIME) ./formats/drivers/qcow2
	$(GO) test -run XXX -fuzz FuzzServe -fuzztime $(FUZZTIME) ./export/nbd
	$(GO) test -run XXX -fuzz FuzzReplies -fuzztime $(FUZZTIME) ./formats/protocols/nbd
	$(GO) test -run XXX -fuzz FuzzParse -fuzztime $(FUZZTIME) ./formats/filters/partition
	$(GO) test -run XXX -fuzz FuzzOpen -fuzztime $(FUZZTIME) ./formats/drivers/vdi
	$(GO) test -run XXX -fuzz FuzzOpen -fuzztime $(FUZZTIME) ./formats/drivers/vpc
	$(GO) test -run XXX -fuzz FuzzOpen -fuzztime $(FUZZTIME) ./formats/drivers/vhdx
	$(GO) test -run XXX -fuzz FuzzOpen -fuzztime $(FUZZTIME) ./formats/drivers/vmdk
	$(GO) test -run XXX -fuzz '^FuzzKernelCacheRequests$$' -fuzztime $(FUZZTIME) ./export/fuse
	$(GO) test -run XXX -fuzz '^FuzzProbeFormat$$' -fuzztime $(FUZZTIME) ./formats/registry
	$(GO) test -run XXX -fuzz '^FuzzConvertRanges$$' -fuzztime $(FUZZTIME) ./formats/jobs/convert
	$(GO) test -run XXX -fuzz '^FuzzDropBacking$$' -fuzztime $(FUZZTIME) ./formats/drivers/qcow2
	$(GO) test -run XXX -fuzz '^FuzzCheck$$' -fuzztime $(FUZZTIME) ./formats/drivers/qcow2
	$(GO) test -run XXX -fuzz '^FuzzAmend$$' -fuzztime $(FUZZTIME) ./formats/drivers/qcow2
	$(GO) test -run XXX -fuzz '^FuzzCheckPartial$$' -fuzztime $(FUZZTIME) ./formats/protocols/remote/http
	$(GO) test -run XXX -fuzz '^FuzzReadRange$$' -fuzztime $(FUZZTIME) ./formats/protocols/remote/http
	$(GO) test -run XXX -fuzz '^FuzzParseContentRange$$' -fuzztime $(FUZZTIME) ./formats/protocols/remote/s3
	$(GO) test -run XXX -fuzz '^FuzzParseURL$$' -fuzztime $(FUZZTIME) ./formats/protocols/remote/s3
	$(GO) test -run XXX -fuzz '^FuzzKeyval$$' -fuzztime $(FUZZTIME) ./export/qmp
	$(GO) test -run XXX -fuzz '^FuzzQMPInput$$' -fuzztime $(FUZZTIME) ./export/qmp

# Unit tests only (no mounts, no root needed for most).
unit:
	$(GO) test -race $$($(GO) list ./... | grep -v /tests)

# Side-by-side benchmark against qemu-storage-daemon at its best (every
# configuration measured, the fastest quoted; about 40 minutes); the report
# lands in docs/bench/, the tables of the areas it ran in docs/bench/README.md.
# BENCHFLAGS="-runtime 3s -only null
# -qemu-config aio=io_uring,iothread" for a quick look.
BENCHFLAGS ?=
bench: build
	.ci/deps
	.ci/s3server
	$(GO) run ./tests/bench $(BENCHFLAGS)

# The man pages in docs/man, generated from the commands' flags (a test
# fails when they are stale). Shell completion: blockexport completion
# bash|zsh|fish.
man: build
	rm -f docs/man/*.1
	./bin/blockexport man docs/man

clean:
	rm -rf bin
