-- Argo CD health check for rolloutfleet.io/RolloutFleet.
-- Healthy: Available=True and neither Progressing nor Degraded is True.
-- Degraded: Degraded=True (invalid spec, pods failing, a rollout that gave up).
-- Progressing: everything else, including a spec the operator has not observed yet.
-- Never Suspended. Written for Argo CD's Lua (5.1); tested in tests/unit/gitops.
local hs = {}

local function condition(conditions, type_)
  if conditions == nil then
    return nil
  end
  for _, c in ipairs(conditions) do
    if c.type == type_ then
      return c
    end
  end
  return nil
end

local function is_true(c)
  return c ~= nil and c.status == "True"
end

local function text(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  if c ~= nil and c.reason ~= nil and c.reason ~= "" then
    return c.reason
  end
  return fallback
end

local status = obj.status
if status == nil or status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report the fleet's status"
  return hs
end

local generation = obj.metadata and obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local available = condition(status.conditions, "Available")
local progressing = condition(status.conditions, "Progressing")
local degraded = condition(status.conditions, "Degraded")

if is_true(degraded) then
  hs.status = "Degraded"
  hs.message = text(degraded, "Degraded")
  return hs
end

if is_true(available) and not is_true(progressing) then
  hs.status = "Healthy"
  local ready = status.readyReplicas or 0
  local replicas = status.replicas or 0
  local serving = "initial weights"
  if status.currentRevision ~= nil then
    serving = "revision " .. tostring(status.currentRevision)
  end
  hs.message = tostring(ready) .. "/" .. tostring(replicas) .. " engines ready, serving " .. serving
  return hs
end

hs.status = "Progressing"
if is_true(progressing) then
  hs.message = text(progressing, "Progressing")
else
  hs.message = text(available, "Waiting for the fleet to become available")
end
return hs
