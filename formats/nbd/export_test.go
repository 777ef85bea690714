package nbd

// Chunk lets the external tests build reply chunks (see chunk).
var Chunk = chunk
