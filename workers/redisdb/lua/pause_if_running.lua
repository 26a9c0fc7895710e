-- Pause a job for a reason, only while it is running (not paused or cancelled already):
-- a worker's pause on its quality warning never overrides an operator's decision.
-- KEYS: the job's hash; ARGV: why (kept as paused_by). 1: paused, 0: left as it was.
local state = redis.call('HGET', KEYS[1], 'state')
if state == false or state == 'running' then
  redis.call('HSET', KEYS[1], 'state', 'paused', 'paused_by', ARGV[1])
  return 1
end
return 0
