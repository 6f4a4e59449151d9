"""Storage tiers for checkpoint shards: local directories and S3-compatible object storage."""
