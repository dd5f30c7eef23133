"""One averaging step: publish, reduce a shard, gather the mean."""
