// Package coroutines schedules requests: the Go form of QEMU's coroutines.
// Each request that must wait runs in its own goroutine from hand-off to
// reply and parks while its I/O is in flight; this package holds what those
// goroutines and the serve loops that start them share:
//
//   - [Handoff]: a serve loop's one decision per request (FUSE queue, NBD
//     connection): finish it in the loop (without waiting, or blocking
//     when the loop is alone) or hand it to a goroutine; [MissTracker]
//     says when trying reads in the loop pays; [Yielder] keeps a loop
//     that never parks from being taken for a hog.
//   - [Path]: how a request came ([Lone], [AfterMiss], [Fresh]), carried
//     on its context down to the I/O layers, which issue its I/O
//     accordingly.
//   - [InFlight]: Begin/End around every request, Drain to wait for all of
//     them (resize, flush-all, shutdown) while holding new ones back.
//   - [Budget]: a bound on what requests hold at once (request buffers),
//     taken in order.
//   - [RangeLock]: overlapping byte ranges serialize, disjoint ones never do.
//
// Buffer pools live in package aio, beside the aligned I/O they serve.
package coroutines
