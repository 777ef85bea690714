package qcow2

import (
	"container/list"
	"sync"
)

// lru is a small mutex-guarded LRU cache keyed by host offset: clean
// decoded L2 tables, clean refcount blocks, decompressed clusters. Two
// goroutines missing on one key may both load it; lookups insert with
// putIfGen, so a copy read from the file while a write-back replaced it
// never lands over the newer one. Changed tables live outside the LRU
// (writeState's pinned maps) until they are written.
type lru[V any] struct {
	mu  sync.Mutex
	cap int
	// generation counts bump calls: a value loaded from the file while it
	// changed may be older than one put meanwhile, see putIfGen.
	generation uint64
	order      *list.List // front = most recently used
	items      map[int64]*list.Element
}

type lruItem[V any] struct {
	key int64
	val V
}

func newLRU[V any](capacity int) *lru[V] {
	return &lru[V]{cap: max(capacity, 1), order: list.New(), items: map[int64]*list.Element{}}
}

func (c *lru[V]) get(key int64) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		c.order.MoveToFront(e)
		return e.Value.(*lruItem[V]).val, true
	}
	var zero V
	return zero, false
}

func (c *lru[V]) put(key int64, val V) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.putLocked(key, val)
}

func (c *lru[V]) putLocked(key int64, val V) {
	if e, ok := c.items[key]; ok {
		e.Value.(*lruItem[V]).val = val
		c.order.MoveToFront(e)
		return
	}
	c.items[key] = c.order.PushFront(&lruItem[V]{key, val})
	for c.order.Len() > c.cap {
		last := c.order.Back()
		c.order.Remove(last)
		delete(c.items, last.Value.(*lruItem[V]).key)
	}
}

// gen returns the current generation.
func (c *lru[V]) gen() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.generation
}

// bump starts a new generation: values loaded before it may be stale.
func (c *lru[V]) bump() {
	c.mu.Lock()
	c.generation++
	c.mu.Unlock()
}

// putIfGen caches val, loaded from the file during generation g, unless a
// newer generation began meanwhile or the key is cached already.
func (c *lru[V]) putIfGen(key int64, val V, g uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, have := c.items[key]; !have && c.generation == g {
		c.putLocked(key, val)
	}
}

// remove drops key: what was cached under it no longer lies there (a
// compressed cluster written where a freed one was).
func (c *lru[V]) remove(key int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		c.order.Remove(e)
		delete(c.items, key)
	}
}
