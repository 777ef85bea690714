// Package lru is the small mutex-guarded LRU cache, keyed by an offset,
// that the formats keep metadata and decoded data in. Why not a library:
// qcow2 inserts what it read only if no write-back replaced it meanwhile
// (PutIfGen), a check made under the cache's own lock, which the LRU
// libraries do not lend.
package lru

import (
	"container/list"
	"sync"
)

// Cache holds up to its capacity of values, dropping the least recently
// used. Two goroutines missing on one key may both load it and Put it.
type Cache[V any] struct {
	mu  sync.Mutex
	cap int
	// generation counts Bump calls: a value loaded from the file while
	// it changed may be older than one put meanwhile, see PutIfGen.
	generation uint64
	order      *list.List // front = most recently used
	items      map[int64]*list.Element
}

type item[V any] struct {
	key int64
	val V
}

// New makes a cache of capacity values (at least one).
func New[V any](capacity int) *Cache[V] {
	return &Cache[V]{cap: max(capacity, 1), order: list.New(), items: map[int64]*list.Element{}}
}

// Get returns the value cached under key, now the most recently used.
func (c *Cache[V]) Get(key int64) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		c.order.MoveToFront(e)
		return e.Value.(*item[V]).val, true
	}
	var zero V
	return zero, false
}

// Put caches val under key (replacing what was there), dropping the
// least recently used values past the capacity.
func (c *Cache[V]) Put(key int64, val V) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.put(key, val)
}

func (c *Cache[V]) put(key int64, val V) {
	if e, ok := c.items[key]; ok {
		e.Value.(*item[V]).val = val
		c.order.MoveToFront(e)
		return
	}
	c.items[key] = c.order.PushFront(&item[V]{key, val})
	for c.order.Len() > c.cap {
		last := c.order.Back()
		c.order.Remove(last)
		delete(c.items, last.Value.(*item[V]).key)
	}
}

// Len is how many values the cache holds.
func (c *Cache[V]) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.order.Len()
}

// Cap is how many values the cache holds at most.
func (c *Cache[V]) Cap() int { return c.cap }

// Gen returns the current generation.
func (c *Cache[V]) Gen() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.generation
}

// Bump starts a new generation: values loaded before it may be stale.
func (c *Cache[V]) Bump() {
	c.mu.Lock()
	c.generation++
	c.mu.Unlock()
}

// PutIfGen caches val, loaded from the file during generation g, unless a
// newer generation began meanwhile or the key is cached already.
func (c *Cache[V]) PutIfGen(key int64, val V, g uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, have := c.items[key]; !have && c.generation == g {
		c.put(key, val)
	}
}

// Remove drops key: what was cached under it no longer lies there.
func (c *Cache[V]) Remove(key int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		c.order.Remove(e)
		delete(c.items, key)
	}
}
