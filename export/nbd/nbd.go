// Package nbd serves one image over the NBD protocol (fixed newstyle), as
// qemu-nbd and qemu-storage-daemon's NBD export do.
//
// What comes from github.com/pojntfx/go-nbd (pkg/protocol), through
// formats/nbd/wire: the magic numbers, the option, option-reply, request and simple-reply headers and
// the INFO structs, with their field layouts. What is written here, because
// go-nbd's server only speaks the baseline (serial READ/WRITE/DISC, a
// backend error drops the connection): NBD_OPT_EXPORT_NAME,
// STRUCTURED_REPLY, LIST/SET_META_CONTEXT (base:allocation), the commands
// FLUSH, TRIM, WRITE_ZEROES (NO_HOLE, FAST_ZERO), BLOCK_STATUS, CACHE and
// FUA, structured replies, truthful transmission flags, and parallel
// processing: each request of a connection runs in its own goroutine and is
// answered when it completes, so replies may come out of order. Requests
// the image finishes without waiting (its TryReadAt and TryWriteAt: null,
// page-cache hits, qcow2 writes in place) are answered inline by the
// connection's reader, and a lone one runs there blocking; the FUSE server
// makes the same decision with the same helper (coroutines.Handoff). The
// reader serves its socket with plain syscalls rather than the netpoller
// (sock_linux.go). A client that goes away cancels its requests' context,
// which aio passes on to the ring. Reads send runs of zeroes as
// OFFSET_HOLE chunks.
package nbd

import "github.com/blockexport/blockexport/formats/nbd/wire"

// The protocol's numbers come from wire (shared with the client in
// formats/nbd); the rest of the package reads them in NBD's words.
const (
	handshakeFlagNoZeroes = wire.HandshakeNoZeroes
	clientFlagFixed       = wire.ClientFixed
	clientFlagNoZeroes    = wire.ClientNoZeroes

	optExportName      = wire.OptExportName
	optStartTLS        = wire.OptStartTLS
	optStructuredReply = wire.OptStructuredReply
	optListMetaContext = wire.OptListMetaContext
	optSetMetaContext  = wire.OptSetMetaContext

	repMetaContext = wire.RepMetaContext
	repErrPolicy   = wire.RepErrPolicy
	repErrInvalid  = wire.RepErrInvalid
	repErrTooBig   = wire.RepErrTooBig

	flagReadOnly        = wire.FlagReadOnly
	flagSendFlush       = wire.FlagSendFlush
	flagSendFUA         = wire.FlagSendFUA
	flagSendTrim        = wire.FlagSendTrim
	flagSendWriteZeroes = wire.FlagSendZeroes
	flagSendDF          = wire.FlagSendDF
	flagSendCache       = wire.FlagSendCache
	flagSendFastZero    = wire.FlagSendFastZero

	cmdFlush       = wire.CmdFlush
	cmdTrim        = wire.CmdTrim
	cmdCache       = wire.CmdCache
	cmdWriteZeroes = wire.CmdWriteZeroes
	cmdBlockStatus = wire.CmdBlockStatus

	cmdFlagFUA      = wire.CmdFlagFUA
	cmdFlagNoHole   = wire.CmdFlagNoHole
	cmdFlagDF       = wire.CmdFlagDF
	cmdFlagReqOne   = wire.CmdFlagReqOne
	cmdFlagFastZero = wire.CmdFlagFastZero

	structuredReplyMagic = wire.MagicStructured
	chunkFlagDone        = wire.ChunkFlagDone
	chunkOffsetData      = wire.ChunkOffsetData
	chunkOffsetHole      = wire.ChunkOffsetHole
	chunkBlockStatus     = wire.ChunkBlockStatus
	chunkError           = wire.ChunkError

	stateHole = wire.StateHole
	stateZero = wire.StateZero

	errPerm      = wire.EPerm
	errIO        = wire.EIO
	errNoMem     = wire.ENoMem
	errInval     = wire.EInval
	errNoSpc     = wire.ENoSpc
	errOverflow  = wire.EOverflow
	errNotSup    = wire.ENotSup
	errShutdown  = wire.EShutdown
	baseAllocID  = uint32(1)
	baseAllocCtx = wire.BaseAllocation

	// Block size constraints we advertise: any byte alignment works, 4 KiB
	// is best, and 32 MiB is the largest request.
	minBlock       = 1
	preferredBlock = 4096
	maxRequest     = 32 << 20
	// maxOptionLen bounds an option's payload (names are at most 4 KiB).
	maxOptionLen = 64 << 10

	magicOldstyle  = wire.MagicOldstyle
	magicOption    = wire.MagicOption
	magicReply     = wire.MagicReply
	magicRequest   = wire.MagicRequest
	magicSimple    = wire.MagicSimple
	handshakeFixed = wire.HandshakeFixed
	optAbort       = wire.OptAbort
	optList        = wire.OptList
	optInfo        = wire.OptInfo
	optGo          = wire.OptGo
	repAck         = wire.RepAck
	repServer      = wire.RepServer
	repInfo        = wire.RepInfo
	repErrUnsup    = wire.RepErrUnsup
	repErrUnknown  = wire.RepErrUnknown
	infoExport     = wire.InfoExport
	infoName       = wire.InfoName
	infoDesc       = wire.InfoDescription
	infoBlockSize  = wire.InfoBlockSize
	flagHasFlags   = wire.FlagHasFlags
	flagMultiConn  = wire.FlagCanMultiConn
	cmdRead        = wire.CmdRead
	cmdWrite       = wire.CmdWrite
	cmdDisc        = wire.CmdDisc
)
