package aio

import "time"

// SetDropBehindIdle is SetDropBehind with sweeps every idle: a test that
// must not race a sweep holds them off.
func SetDropBehindIdle(f File, idle time.Duration) bool { return setDropBehind(f, idle) }
