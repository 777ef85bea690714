# blockexport — see README.md.
GO      ?= go
IMAGE   ?= null:1G
MOUNT   ?= /tmp/blockexport.export
FLAGS   ?= --writable

.PHONY: build run test unit vet bench clean

build:
	$(GO) build -o bin/blockexport ./cmd/blockexport

# Export IMAGE (default: the built-in 1 GiB null device) at MOUNT in the
# foreground; Ctrl-C unmounts and exits.
run: build
	./bin/blockexport fuse $(FLAGS) $(IMAGE) $(MOUNT)

# The whole suite: unit tests and end-to-end tests with real mounts and
# clients. Installs missing client tools first (as root).
test:
	.ci/deps
	$(GO) vet ./...
	$(GO) test -race -timeout 20m ./...

# Unit tests only (no mounts, no root needed for most).
unit:
	$(GO) test -race $$($(GO) list ./... | grep -v /tests)

clean:
	rm -rf bin
