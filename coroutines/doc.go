// Package coroutines coordinates requests that run as goroutines: the Go
// form of QEMU's coroutines. Each request runs in its own goroutine from
// decode to reply and parks while its I/O is in flight; this package holds
// what those goroutines and the loops that start them share:
//
//   - [Handoff]: a serve loop's one decision per request (FUSE queue, NBD
//     connection): finish it in the loop (without waiting, or blocking
//     when the loop is alone) or hand it to a goroutine; [MissTracker]
//     says when trying reads in the loop pays.
//   - [Lone] and [Missed]: what the loop knows of a request, carried on
//     its context down to aio, which issues the I/O accordingly.
//   - [InFlight]: Begin/End around every request, Drain to wait for all of
//     them (resize, flush-all, shutdown) while holding new ones back.
//   - [RangeLock]: overlapping byte ranges serialize, disjoint ones never do.
package coroutines
