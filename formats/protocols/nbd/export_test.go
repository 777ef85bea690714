package nbd

// Chunk and ExtChunk let the external tests build reply chunks (see
// chunk, extChunk).
var (
	Chunk    = chunk
	ExtChunk = extChunk
)
