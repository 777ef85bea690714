package coroutines

import "context"

// loneKey marks a context as a lone request's: see Lone.
type loneKey struct{}

// Lone marks ctx as carrying a lone request: its caller has nothing else to
// serve until the request completes (a serve loop with no other request in
// flight and none waiting to be read). I/O layers may then block the
// calling thread in a plain system call, whose completion wakes that very
// thread, instead of submitting to a shared ring and parking: measured at
// queue depth one, a 4 KiB O_DIRECT read through the ring made three
// threads wake in turn (the submitter for the completion's task work, the
// completion goroutine, the waiter) and took twice as long. Requests with
// company keep using the ring, where their submissions batch.
//
// Make one such context and reuse it: Lone allocates.
func Lone(ctx context.Context) context.Context { return context.WithValue(ctx, loneKey{}, true) }

// IsLone says whether ctx was marked by Lone.
func IsLone(ctx context.Context) bool { return ctx.Value(loneKey{}) != nil }
