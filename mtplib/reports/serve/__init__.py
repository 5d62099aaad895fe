"""The reports of evidence/serve/: `mtplib serve` against the library, batched requests,
batch steps, reconnects, and structured output."""
