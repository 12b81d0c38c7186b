"""Pieces of the chunked linear-attention kernels that more than one op family uses: where a chunk's rows
are (`chunk_index`), the in-chunk gate cumsum (`cumsum`), and the inter-chunk state pass (`state_pass`)."""
