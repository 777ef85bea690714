package main

import (
	"log"
	"os"
	"strings"
)

// benchURing runs the matrix on target with our two transports side by
// side: FUSE over io_uring (the "ours" column) against our own /dev/fuse
// loop (the other column, named so), with the fuse module's enable_uring
// switched on for the run and put back after.
func benchURing(target, dir string, ours func(extra ...string) system) []row {
	const param = "/sys/module/fuse/parameters/enable_uring"
	old, err := os.ReadFile(param)
	if err != nil {
		log.Printf("uring rows skipped: %v", err)
		return nil
	}
	if err := os.WriteFile(param, []byte("1"), 0); err != nil {
		log.Printf("uring rows skipped: %v", err)
		return nil
	}
	defer func() {
		v := "0"
		if strings.TrimSpace(string(old)) == "Y" {
			v = "1"
		}
		os.WriteFile(param, []byte(v), 0)
	}()
	uring := ours("--io-uring", "on")
	loop := ours()
	loop.ours, loop.config = false, "its /dev/fuse loop"
	return benchTarget(target, dir, []system{uring, loop}, " (io_uring vs /dev/fuse)", nil)
}
