#include "textflag.h"

// Weights of a 16-byte chunk's bytes in s2: 16 for its first byte down
// to 1 for its last, as 16-bit words (low half, high half).
DATA weightsLo<>+0(SB)/8, $0x000d000e000f0010
DATA weightsLo<>+8(SB)/8, $0x0009000a000b000c
GLOBL weightsLo<>(SB), RODATA|NOPTR, $16
DATA weightsHi<>+0(SB)/8, $0x0005000600070008
DATA weightsHi<>+8(SB)/8, $0x0001000200030004
GLOBL weightsHi<>(SB), RODATA|NOPTR, $16

// func adlerChunks(p []byte) (sum, psum, wsum uint64)
// Over the 16-byte chunks of p (len(p)/16 of them; the weighted sums'
// 32-bit lanes hold 366k chunks, callers pass 4096): the
// bytes' sum, the sum over chunks of the bytes before each, and the sum
// of each byte weighted 16..1 by its place in its chunk. SSE2 only.
TEXT ·adlerChunks(SB), NOSPLIT, $0-48
	MOVQ p_base+0(FP), SI
	MOVQ p_len+8(FP), CX
	SHRQ $4, CX
	PXOR X0, X0
	PXOR X1, X1
	PXOR X2, X2
	PXOR X3, X3
	MOVOU weightsLo<>(SB), X6
	MOVOU weightsHi<>(SB), X7
loop:
	TESTQ CX, CX
	JZ done
	MOVOU (SI), X4
	PADDQ X1, X2
	MOVO X4, X5
	PSADBW X0, X5
	PADDQ X5, X1
	MOVO X4, X5
	PUNPCKLBW X0, X4
	PUNPCKHBW X0, X5
	PMADDWL X6, X4
	PMADDWL X7, X5
	PADDL X4, X3
	PADDL X5, X3
	ADDQ $16, SI
	DECQ CX
	JMP loop
done:
	MOVQ X1, AX
	PSHUFD $0x4e, X1, X1
	MOVQ X1, BX
	ADDQ BX, AX
	MOVQ AX, sum+24(FP)
	MOVQ X2, AX
	PSHUFD $0x4e, X2, X2
	MOVQ X2, BX
	ADDQ BX, AX
	MOVQ AX, psum+32(FP)
	XORQ AX, AX
	MOVL X3, BX
	ADDQ BX, AX
	PSHUFD $0x39, X3, X3
	MOVL X3, BX
	ADDQ BX, AX
	PSHUFD $0x39, X3, X3
	MOVL X3, BX
	ADDQ BX, AX
	PSHUFD $0x39, X3, X3
	MOVL X3, BX
	ADDQ BX, AX
	MOVQ AX, wsum+40(FP)
	RET
