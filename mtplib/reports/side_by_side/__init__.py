"""The reports of evidence/side-by-side/profile/: where plain decoding's time goes outside
upstream's C calls, and what the C decode itself costs."""
