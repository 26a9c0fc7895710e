-- A stored batch's leftover progress, dropped unless a run owns the batch (a live run's
-- progress is its own). KEYS: owner, progress. 1: dropped (nobody owns it), 0: owned.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2])
return 1
